"""The check of exercise 16, the capstone: attention written out, GPT-2 assembled, then trained by train.py.

0. What the student wrote: no class of the answer file derives from one of model.py's (read from its text, and
   from the classes of the GPT it builds); torch's scaled_dot_product_attention is refused while the answer runs
   (a function mode and a dispatch mode: an answer that calls it fails in one sentence); the GPT calls every one
   of the student's exercise-10 parts. Pasted code cannot be told from written code: a copy of model.py's
   attention written out by hand passes, as a correct answer does.

1. The student's `attention` against F.scaled_dot_product_attention on random queries, keys and values: causal,
   with a cache (fewer queries than keys), and with a given mask; values, then the gradients of q, k and v.
2. The student's GPT against model.py's, built on the same seed: the same parameters by name, order and value,
   the same logits (with and without sample.py's KV cache), loss, and gradient of every weight; the same hidden
   states on packed rows (`pos` and `attn_mask`); in training mode with dropout 0.1, the same loss and
   gradients on the same seed.
3. The real trainer trains the student's GPT (`train.model_module`, in the answer's process) and model.py's (in
   this one, meanwhile) on the same seed and data, and the two whole loss curves must match. The answer's
   process could fake this curve (it runs the answer's code), so what only training uses (dropout, the
   training mode) is also checked from data in 2: the curve shows the trainer takes the student's GPT.
"""

import ast
import random
import tempfile

import torch
import torch.nn.functional as F

from exercises.grader.checking import ExerciseFailed, compared, gradient_advice, is_close, run_training, shown
from exercises.grader.feed_capstone import (PARTS, assembly_answers, trained_with_dropout, training_answers,
                                            training_args, with_gradients)


# ----------------------------------------------------------------------------- 1. attention


def attention_cases(rng):
    cases = []
    for kind in ("causal", "causal", "cache", "cache", "mask"):
        B, H, hs, Tk = rng.randint(1, 2), rng.choice([1, 2, 4]), rng.choice([4, 8]), rng.randint(3, 10)
        Tq = Tk if kind != "cache" else rng.randint(1, Tk - 1)
        allowed = None
        if kind == "mask":  # packed rows: each query sees some keys, itself always
            allowed = (torch.rand(B, 1, Tq, Tk) < 0.5) | torch.eye(Tq, Tk, dtype=torch.bool)
            # and the first (as a document's first token): a query that sees itself alone gives q no gradient, which
            # F.scaled_dot_product_attention gives as float noise (1e-7) and a right answer as zeros, so with too few
            # queries that see more, the noise would be a sizable part of q's gradient
            allowed[..., 0] = True
        cases.append({"kind": kind, "q": torch.randn(B, H, Tq, hs), "k": torch.randn(B, H, Tk, hs),
                      "v": torch.randn(B, H, Tk, hs), "allowed": allowed, "upstream": torch.randn(B, H, Tq, hs)})
    return cases


def sdpa(q, k, v, allowed):
    """F.scaled_dot_product_attention as model.py calls it: causal, or with a mask (a cache: the queries last)."""
    Tq, Tk = q.size(-2), k.size(-2)
    if allowed is None and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if allowed is None:
        allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def attention_advice(case, value):
    q, k, v, allowed = case["q"], case["k"], case["v"], case["allowed"]
    if torch.isnan(value).any():
        return "some rows are NaN: a softmax over scores that are all -inf; every query must see its own position"
    if torch.allclose(value, F.scaled_dot_product_attention(q, k, v), atol=1e-5):
        return ("when `allowed` is given it is the mask: a query sees exactly the keys it allows" if case["kind"] ==
                "mask" else "no mask was applied: a query may see its own position and the ones before, never a later "
                            "one")
    if allowed is None:
        allowed = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril(diagonal=k.size(-2) - q.size(-2))
    if torch.allclose(value, F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0), atol=1e-5):
        return "divide the scores by sqrt(head size) before the softmax"
    if case["kind"] == "cache":
        return ("with a cache the Tq queries are the last of the Tk positions, so query i sees the keys up to "
                "position Tk - Tq + i (a mask of tril(diagonal=Tk - Tq))")
    if case["kind"] == "mask":
        return "when `allowed` is given it is the mask: a query sees exactly the keys it allows"
    return "the scores are q @ kᵀ / sqrt(head size), masked with -inf, softmaxed over the keys, then times v"


def compare_attention(cases, mine):
    for case, (value, grads) in zip(cases, mine):
        want, want_grads = with_gradients(sdpa, case)
        shape = f"({case['kind']}: {case['q'].size(-2)} queries, {case['k'].size(-2)} keys)"
        if not torch.is_tensor(value) or value.shape != want.shape:
            raise ExerciseFailed(f"attention returned {shown(value)[:50]} of shape "
                                 f"{tuple(getattr(value, 'shape', ()))} where F.scaled_dot_product_attention gives "
                                 f"{tuple(want.shape)} {shape}.")
        if not torch.allclose(value, want, rtol=1e-4, atol=1e-5):
            raise ExerciseFailed(f"attention differs from F.scaled_dot_product_attention by up to "
                                 f"{(value - want).abs().max().item():.3g} {shape}: {attention_advice(case, value)}.")
        for name in "qkv":
            wrong = gradient_advice(name, grads.get(name), want_grads[name], truth="F.scaled_dot_product_attention's")
            if wrong:
                raise ExerciseFailed(f"attention {shape}: {wrong}.")


# ----------------------------------------------------------------------------- 2. the assembly


def packed_rows(rng, T):
    """(pos, attn_mask) of two rows that each pack documents of random lengths, as hellaswag_eval.py packs its
    endings: each token sees the tokens of its own document up to itself, at positions counted from 0 in it."""
    pos, mask = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, 1, T, T, dtype=torch.bool)
    for row in range(2):
        start = 0
        while start < T:
            end = min(T, start + rng.randint(2, T - 1))
            pos[row, start:end] = torch.arange(end - start)
            mask[row, 0, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
            start = end
    return pos, mask


def compare_weights(mine, names, reference):
    """`mine`: the student's GPT's parameters by name; `names`: every name of them (a tied weight's two)."""
    want = dict(reference.named_parameters())
    every = [name for name, _ in reference.named_parameters(remove_duplicate=False)]
    # (a tied weight is kept under the name of whichever of its modules comes first: a matter of order)
    missing = [name for name in every if name not in names]
    extra = [name for name in names if name not in every]
    if missing or extra:
        what = f"no {missing[0]}" if missing else f"a {extra[0]} that model.py's has not"
        raise ExerciseFailed(f"your GPT has {what}: give the modules model.py's names (a checkpoint, param_groups and "
                             f"the FLOP count read the model by them).")
    if list(mine) != list(want):
        at = next(i for i, (a, b) in enumerate(zip(mine, want)) if a != b)
        raise ExerciseFailed(f"your GPT's parameter {at + 1} is {list(mine)[at]} where model.py's is {list(want)[at]}: "
                             f"create the modules in model.py's order, so that the same seed draws the same weights.")
    for name, weight in want.items():
        if mine[name].shape != weight.shape:
            raise ExerciseFailed(f"your {name} has shape {tuple(mine[name].shape)} where model.py's has "
                                 f"{tuple(weight.shape)}.")
        if not torch.equal(mine[name], weight):
            raise ExerciseFailed(f"on the same seed your {name} differs from model.py's: build every module before "
                                 f"tying and initialising, then apply your init_weights to every module in order "
                                 f"(self.apply), as model.py's GPT.__init__ does.")


def compare_gpt(mine, reference, inputs):
    if not mine["tied"]:
        raise ExerciseFailed("your GPT's lm_head and transformer.wte are two weights: tie them (your tie_weights).")
    idx, targets = inputs["idx"], inputs["targets"]
    with torch.no_grad():
        logits = reference(idx)
    if not torch.allclose(mine["logits"], logits, rtol=1e-4, atol=1e-5):
        raise ExerciseFailed("with model.py's weights your GPT's logits differ from model.py's: hidden_states is "
                             "embed, dropout, every block in order, then ln_f; forward applies lm_head to it.")
    if not torch.allclose(mine["cached"], logits, rtol=1e-4, atol=1e-5):
        raise ExerciseFailed("fed the same tokens in two pieces through sample.py's KVCache, your GPT's logits differ "
                             "from one pass over all of them: append the new keys and values to the cache, and start "
                             "the positions at kv_cache.length.")
    loss = reference(idx, targets)
    loss.backward()
    if not (torch.is_tensor(mine["loss"]) and is_close(mine["loss"].item(), loss.item(), rel=1e-5)):
        raise ExerciseFailed(f"your GPT's loss is {shown(mine['loss'])}, {compared(mine['loss'], loss.item())} "
                             f"model.py's: with targets, forward returns your next_token_loss of the logits.")
    for name, p in reference.named_parameters():
        wrong = gradient_advice(name, mine["grads"].get(name), p.grad)
        if wrong:
            raise ExerciseFailed(f"your GPT: {wrong}.")
    with torch.no_grad():
        packed = reference.hidden_states(idx, pos=inputs["pos"], attn_mask=inputs["attn_mask"])
    if not (torch.is_tensor(mine["packed"]) and mine["packed"].shape == packed.shape
            and torch.allclose(mine["packed"], packed, rtol=1e-4, atol=1e-5)):
        raise ExerciseFailed("on packed rows (several documents in a row, as hellaswag_eval.py sends them) your GPT's "
                             "hidden_states differ from model.py's: embed each token at its given `pos`, and give "
                             "`attn_mask` to every block's attention as `allowed`.")


def compare_dropout(mine, inputs):
    from model import GPT

    want = trained_with_dropout(lambda config: GPT(config, loss_path="full"), inputs)
    dropped = ("the embeddings (transformer.drop), then in each block the attention weights (model.py's dropout_p), "
               "the attention's output (resid_dropout) and the MLP's output (mlp.dropout), in that order")
    if not (torch.is_tensor(mine["loss"]) and is_close(mine["loss"].item(), want["loss"].item(), rel=1e-5)):
        raise ExerciseFailed(f"in training mode with dropout 0.1 your GPT's loss differs from model.py's on the same "
                             f"seed, though it matched without dropout: model.py drops out {dropped}.")
    for name, grad in want["grads"].items():
        wrong = gradient_advice(name, mine["grads"].get(name), grad)
        if wrong:
            raise ExerciseFailed(f"your GPT in training mode with dropout 0.1: {wrong}.")


YOURS = "the capstone is yours to write, so your classes derive from torch's nn.Module, not from model.py's"


def borrowed_class(source):
    """"your CLASS derives from model.py's BASE" for the first class of the answer file `source` whose bases name
    one of model.py's classes (model.GPT, or a name imported from model), read from the text without running it;
    else None."""
    tree = ast.parse(source)
    modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name == "model"}
    imported = {alias.asname or alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "model" for alias in node.names}
    for node in ast.walk(tree):
        for base in getattr(node, "bases", []):
            if (isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in modules) \
                    or (isinstance(base, ast.Name) and base.id in imported):
                return f"your {node.name} derives from model.py's {getattr(base, 'attr', None) or base.id}"
    return None


# ----------------------------------------------------------------------------- 3. trained by train.py


def check_capstone(answers, data_root="", steps=12, quick_start=True):
    """Your attention and GPT against model.py, then your GPT trained by train.py against model.py's, at the quick
    start's shape (config/shakespeare.py: 4 layers x 128 wide) or, with quick_start=False, a tiny one (tests)."""
    from model import GPT, GPTConfig

    rng = random.Random(random.getrandbits(64))
    heads = rng.choice([1, 2, 4])
    shape = dict(n_layer=rng.randint(1, 3), n_head=heads, n_embd=heads * rng.choice([8, 16]), block_size=16,
                 vocab_size=rng.choice([64, 100]), bias=rng.random() < 0.7)
    tokens = torch.randint(0, shape["vocab_size"], (2, 13))
    pos, attn_mask = packed_rows(rng, 12)
    inputs = {"attention": attention_cases(rng), "config": shape, "seed": rng.randint(0, 10**6),
              "idx": tokens[:, :-1], "targets": tokens[:, 1:], "pos": pos, "attn_mask": attn_mask}
    borrowed = borrowed_class(answers.path.read_text(encoding="utf-8"))
    if borrowed:
        raise ExerciseFailed(f"{borrowed}: {YOURS}.")
    mine = answers.run(assembly_answers, inputs)
    if mine["borrowed"]:
        raise ExerciseFailed(f"your GPT's {mine['borrowed']}: {YOURS}.")
    unused = [name for name in PARTS if name not in mine["parts"]]
    if unused:
        raise ExerciseFailed(f"your GPT never calls your {', '.join(unused)} of exercise 10 (exercises/10_gpt.py): "
                             f"the capstone assembles GPT-2 from your parts, so call each where model.py does that "
                             f"work.")
    compare_attention(inputs["attention"], mine["attention"])
    torch.manual_seed(inputs["seed"])
    reference = GPT(GPTConfig(**shape), loss_path="full").eval()
    compare_weights(mine["weights"], mine["names"], reference)
    compare_gpt(mine, reference, inputs)
    compare_dropout(mine["dropout"], inputs)
    running = answers.start(training_answers, (answers.data_root(data_root), steps, quick_start))
    with tempfile.TemporaryDirectory() as out:
        want = [row["train/loss"] for row in run_training(training_args(data_root, steps, quick_start, out))]
    curve = running.result()
    if not isinstance(curve, list) or len(curve) != len(want):
        logged = len(curve) if isinstance(curve, list) else "no"
        raise ExerciseFailed(f"trained by train.py for {steps} steps, your run logged {logged} losses where model.py's "
                             f"logs {len(want)}: train.py must run every step with your GPT (--train.model_module), "
                             f"and the whole curve is compared.")
    for step, (got, expected) in enumerate(zip(curve, want), 1):
        if not is_close(got, expected, rel=1e-5 if step == 1 else 1e-3):
            raise ExerciseFailed(f"trained by train.py, your GPT's loss at step {step} is {shown(got)}, "
                                 f"{compared(got, expected)} model.py's on the same seed and data, though every part "
                                 f"matched: look for what "
                                 f"only training uses (dropout, a module left in eval mode, a buffer).")
    where = "the quick start's shape" if quick_start else "a tiny shape"
    return (f"your attention matches F.scaled_dot_product_attention and your GPT model.py's, weights, logits and "
            f"gradients; train.py trained it at {where} for {steps} steps with model.py's loss curve: "
            f"{want[0]:.4f} at step 1, {want[-1]:.4f} at step {steps} (yours: {curve[-1]:.4f}).")
