"""The hints of every exercise, printed one level at a time by `python exercises/check.py N --hint[=LEVEL]`.

Level 1 says where to look; level 2 names the idea and the line of the project to read, never the
algorithm or its constants; level 3 is what the teacher compares an answer with, for a student who gives
up: the reference answer's functions, read (never run) from the project's answer file. A student's copy
holds no reference (make_student_copy.py blanks the answers and copies no solutions), so there level 3
comes from the teacher's copy (`check.py N --hint=3 --against=TEACHER`).
The exercise files themselves hold only the goal and the signatures, so a student reads a hint only by
asking for it.
"""

import ast
from pathlib import Path

from exercises.grader.make_student_copy import STUDENT_COPY

HERE = Path(__file__).resolve().parents[1]  # exercises/

HINTS = {
    1: ("optimizer.py, `Schedule.lr_at`; the comment above it states each schedule in words.",
        "The idea: a schedule is a piecewise function of the step, one piece per phase. Read "
        "optimizer.py's comment above `Schedule.lr_at`: it states each phase in words, with the "
        "step each one starts at."),
    2: ("train.py, `train_step`: its loop over micro-steps, and the comment on dividing the loss.",
        "The idea: `.grad` is a sum, so the micro-steps must add up to the whole batch's mean. "
        "Read the comment on dividing the loss in train.py's `train_step`."),
    3: ("model.py, `CausalSelfAttention.forward` (its last branch, with is_causal=True).",
        "The idea: each query may only see the keys of positions at or before its own. Read the "
        "branch of model.py's `CausalSelfAttention.forward` that calls "
        "F.scaled_dot_product_attention with is_causal=True, and that function's documentation."),
    4: ("model.py, `GPT.flops_per_token`; metrics.py, `mfu` (throughput/mfu, which `StepClock.lap` "
        "logs); PaLM, appendix B.",
        "The idea: count the multiplications a token causes, forward and backward, including the "
        "ones that have no parameters. Read the docstring of model.py's `GPT.flops_per_token`, "
        "then PaLM's appendix B."),
    5: ("metrics.py, `MetricRecorder.record_metric` (its docstring on `reduce`); train.py's loop calls "
        "`recorder.record_all(step_metrics)` after every `train_step`.",
        "The idea: the metric must stay on the device until the recorder reduces it, and the "
        "reduce type says what several ranks' values mean together. Read the docstring of "
        "metrics.py's `MetricRecorder.record_metric`."),
    6: ("checkpoint.py, `TrainState` (`to_dict`, `from_dict`), `rng_state`, `set_rng_state`, "
        "`Checkpointer.save`; run_dir.py's `load_start`, where a resume restores them.",
        "The idea: a resume is exact only when everything that draws or counts is saved and put "
        "back. Read checkpoint.py's `Checkpointer.save`, and the comment on each field of "
        "`TrainState`."),
    7: ("hellaswag_eval.py: `Task`, the format functions (`boolq(doc)` has the same shape) and `TASKS`; OLMo's "
        "class RTE in olmo_eval/tasks.py.",
        "The idea: a task is a format function plus where its data lives and how it is scored. "
        "Read hellaswag_eval.py's `boolq` and its row in `TASKS`, then OLMo's RTE class."),
    8: ("lab/scaling_law.py: `predict`, `tokens_to_reach`, `optimal_tokens_per_param`; Hoffmann et al. 2022, "
        "eq. 4.",
        "The idea: each question is the fitted law, solved for another of its variables. Read "
        "lab/scaling_law.py's `tokens_to_reach` and `optimal_tokens_per_param`, and Hoffmann et al. "
        "2022, eq. 4."),
    9: ("optimizer.py, `param_groups` and `build_optimizer`; `python train.py --optim.name=muon --dry_run` prints "
        "the split.",
        "The idea: each parameter goes to one optimizer according to what it is, never by its "
        "name. Read optimizer.py's `param_groups`, and the split the dry run prints."),
    10: ("model.py: `MLP`, `Block`, `GPT.__init__` (the tying), `GPT._init_weights`, `GPT.hidden_states`, and "
         "`GPT.forward`'s full path.",
         "The idea: every part must match model.py in its gradient too, not only its value. Read "
         "model.py's `MLP.forward`, `Block.forward`, `GPT._init_weights` and the tying line of "
         "`GPT.__init__`."),
    11: ("GPT-2's encoder.py (`bpe`) and Sennrich et al. 2016; vocab.bpe lists the merges in rank order.",
         "The idea: merges are applied by rank, the earliest learned first, never by how often a "
         "pair occurs. Read `bpe` in GPT-2's encoder.py and section 3.2 of Sennrich et al. 2016."),
    12: ("Loshchilov & Hutter 2019, Algorithm 2; PyTorch's AdamW documentation.",
         "The idea: AdamW's weight decay acts on the weights directly, apart from the moments. "
         "Read Algorithm 2 of Loshchilov & Hutter 2019, and the update formula of PyTorch's AdamW"
         " page."),
    13: ("train.py's `train_step` calls torch.nn.utils.clip_grad_norm_ and logs what it returns.",
         "The idea: all the gradients are clipped as one vector, by one factor. Read train.py's "
         "`train_step` where it calls clip_grad_norm_, and that function's documentation."),
    14: ("data.py, `TokenLoader.next_batch`.",
         "The idea: at each micro-step the ranks read neighbouring sequences, never the same "
         "ones. Read data.py's `TokenLoader.next_batch`."),
    15: ("torch.distributed: `all_reduce` and `ReduceOp`; train.py's `wrap_model` (DDP does this for the trainer).",
         "The idea: the gradient of the whole batch is the mean of the ranks' gradients. Read the"
         " documentation of torch.distributed.all_reduce and its ReduceOp."),
    16: ("model.py: `CausalSelfAttention`, `MLP`, `Block`, `GPT` (their __init__ and forward, in that order); "
         "sample.py's `KVCache` (what `append` and `length` give).",
         "The idea: your model must be model.py's, module for module, so that the same seed gives"
         " the same weights. Read model.py's `CausalSelfAttention`, `Block` and "
         "`GPT.hidden_states`, and sample.py's `KVCache`."),
    17: ("train.py: `start_processes` (the autocast) and `train_step`; model.py: `GPT.forward`'s full path; "
         "PyTorch's Automatic Mixed Precision page (which ops autocast runs in lower precision).",
         "The idea: autocast chooses the precision of each operation; the model's weights stay "
         "float32. Read train.py's `train_step` (`with ... autocast:`) and PyTorch's Automatic "
         "Mixed Precision page."),
    18: ("GPT-2's encoder.py (`bytes_to_unicode` and its `pat`); tiktoken_ext's `r50k_pat_str` is the same "
         "pattern.",
         "The idea: every byte gets a printable character of its own, and the text is split "
         "before any merge. Read `bytes_to_unicode` and `pat` in GPT-2's encoder.py."),
    19: ("Sennrich et al. 2016 (Algorithm 1); the tokenizers library's BpeTrainer.",
         "The idea: each round merges the pair that is most frequent over the whole corpus. Read "
         "Algorithm 1 of Sennrich et al. 2016."),
    20: ("train.py, `train_step` (the `no_sync` line and its comment); torch's DistributedDataParallel.no_sync.",
         "The idea: DDP's all-reduce is needed once per optimizer step, not once per micro-step. "
         "Read train.py's `train_step` (the `no_sync` line and its comment)."),
    21: ("sample.py, `KVCache` and `generate`; model.py's attention (`kv_cache.append`) and "
         "`GPT.hidden_states` (`kv_cache.length`).",
         "The idea: keys and values of tokens already read never change, so they are kept, not "
         "recomputed. Read sample.py's `KVCache` and `generate`."),
    22: ("Smith 2017, section 3.3; fastai's `lr_find` and its `minimum` suggestion.",
         "The idea: read the range test as fastai's lr_find reads it, on a smoothed curve. Read "
         "section 3.3 of Smith 2017 and the docstring of `suggest_lr`."),
    23: ("metrics.py, `LossSpikeDetector`; docs/checkpoints-and-reliability.md, \"Rewinding in place\".",
         "The idea: a spike is judged against the recent past, and a rewind must go back before "
         "the update that made it. Read metrics.py's `LossSpikeDetector`."),
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
