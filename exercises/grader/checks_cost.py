"""The checks of exercises 4 and 5: what a step costs and what it logs.

Each compares the student's answers with the project's code (checking.py says how a check works, and
grading.py how the answer runs apart): 4 FLOPs and MFU (model.py's count, metrics.py's speed metrics),
5 a new metric through the real loop (metrics.py's MetricRecorder, in a real training run).
"""

import functools
import math
import random
import tempfile

import torch

from exercises.grader.checking import ExerciseFailed, compared, is_close, shown
from exercises.grader.feed_cost import metric_answers, metric_run, mfu_answers

# ----------------------------------------------------------------------------- 4. FLOPs and MFU


def flops_advice(c, gap):
    """What a FLOP count that is `gap` short of the project's most likely left out, for config `c`."""
    named = {12 * c.n_layer * c.n_embd * c.block_size: "attention's 12 x n_layer x n_embd x block_size",
             6 * c.n_embd * c.vocab_size: "the output layer's 6 x n_embd x vocab_size (a matmul, though its weights "
                                          "are the token embedding's)",
             -6 * c.n_embd * c.block_size: "6 x the position embedding, which is a lookup and costs no FLOPs"}
    missing = next((what for amount, what in named.items() if math.isclose(gap, amount)), None)
    return (f"the difference is {missing}" if missing
            else "compare your 6N with the hint (which parameters multiply) and add attention's term")


def check_mfu(answers):
    from metrics import mfu
    from model import GPT, GPTConfig

    shapes = [{}]  # GPT-2 (124M) first, then random shapes
    for _ in range(12):
        heads = random.randint(1, 16)
        shapes.append(dict(n_layer=random.randint(1, 12), n_head=heads, n_embd=heads * random.choice([16, 32, 64, 128]),
                           block_size=random.choice([16, 128, 1024, 2048]), vocab_size=random.randint(100, 60000)))
    speeds, wants = [], []
    for _ in range(20):
        flops, tokens_per_step, seconds = random.uniform(1e5, 1e10), random.randint(1, 10**6), random.uniform(1e-3, 10)
        world_size, peak = random.randint(1, 64), random.uniform(1e11, 1e16)
        speeds.append((flops, tokens_per_step / seconds, world_size, peak))
        wants.append(mfu(flops, tokens_per_step / seconds, world_size, peak))
    mine = answers.run(mfu_answers, {"shapes": shapes, "speeds": speeds})
    for shape, count in zip(shapes, mine["flops"]):
        c = GPTConfig(**shape)
        with torch.device("meta"):
            want = GPT(c).flops_per_token()
        if not is_close(count, want):
            try:
                advice = flops_advice(c, want - float(count))
            except (TypeError, ValueError):
                advice = "return the count as a number"
            text = f"{count:,}" if isinstance(count, int) else shown(count)
            raise ExerciseFailed(f"flops_per_token is {text}, {compared(count, want)} what GPT.flops_per_token gives "
                                 f"for n_layer {c.n_layer}, n_embd {c.n_embd}, block_size {c.block_size}, vocab_size "
                                 f"{c.vocab_size}: {advice}.")
    for (flops, tokens_per_sec, world_size, peak), value, want in zip(speeds, mine["mfu"], wants):
        if not is_close(value, want):
            if is_close(value, want * world_size):
                advice = "tokens_per_sec counts every rank together and MFU is per device: divide by world_size"
            elif is_close(value, want * 100):
                advice = "MFU is a fraction between 0 and 1, not a percentage"
            else:
                advice = "MFU is the model's FLOP/s per device over one device's peak"
            raise ExerciseFailed(f"mfu is {shown(value)}, {compared(value, want)} what metrics.mfu gives "
                                 f"for {flops:.4g} FLOPs per "
                                 f"token, {tokens_per_sec:.4g} tokens/s on {world_size} device(s) of {peak:.4g} "
                                 f"FLOP/s: {advice}.")
    with torch.device("meta"):
        gpt2 = GPT(GPTConfig()).flops_per_token()
    h100 = gpt2 * 560_104 / 989e12  # README.md's speed on one H100 (docs/measurements.md)
    return (f"flops_per_token matches model.py on 13 shapes and mfu matches metrics.py; GPT-2 (124M) costs "
            f"{gpt2:,} FLOPs per token, so README.md's 560,104 tokens/s on one H100 (989 TFLOP/s) is {h100:.1%} MFU.")


# ----------------------------------------------------------------------------- 5. a new metric


def update_ratio(model, weights_before):
    """||W_after - W_before|| / ||W_before|| over every parameter together: the check's own value."""
    change = sum(((p.detach() - weights_before[name]) ** 2).sum() for name, p in model.named_parameters())
    size = sum((weights_before[name] ** 2).sum() for name, _ in model.named_parameters())
    return (change / size).sqrt().item()


@functools.lru_cache(maxsize=None)
def expected_ratios(data_root):
    """The update ratio of every step of the run (a seeded run: the same for every answer graded here)."""
    expected = []
    with tempfile.TemporaryDirectory() as out:
        metric_run(data_root, out, lambda run, raw_model, before: expected.append(update_ratio(raw_model, before)))
    return tuple(expected)


def check_metric(answers, data_root=""):
    running = answers.start(metric_answers, answers.data_root(data_root))
    expected = expected_ratios(str(data_root))
    mine = running.result()
    if mine["syncs"]:
        raise ExerciseFailed(f"your record_update_ratio calls .{mine['syncs'][0].strip('_')}() on a tensor, which "
                             f"makes the host wait for the device every step on a GPU: keep every sum on tensors "
                             f"(torch.stack, torch.linalg.vector_norm) and record the tensor itself.")
    names = sorted({note["name"] for note in mine["notes"]})
    if "optim/update_ratio" not in names:
        raise ExerciseFailed(f"you recorded {', '.join(map(str, names))} but the check looks for optim/update_ratio: "
                             f"record it under that name." if names else "record_update_ratio recorded nothing: call "
                             "recorder.record_metric(\"optim/update_ratio\", ratio, reduce=...).")
    note = next(note for note in mine["notes"] if note["name"] == "optim/update_ratio")
    if not note["is_tensor"]:
        raise ExerciseFailed(f"you recorded a Python {note['type']}, and making one (.item(), float()) makes the host "
                             f"wait for the device every step on a GPU: record the tensor itself.")
    if note["reduce"] in ("sum", "l2_norm"):
        raise ExerciseFailed(f"you recorded it with reduce={note['reduce']!r}, which on 2 ranks logs "
                             f"{'twice' if note['reduce'] == 'sum' else 'sqrt(2) times'} the ratio, as every rank "
                             f"holds the same weights: use reduce=\"mean\" (or \"max\", or None for rank 0's value).")
    for step, (got, want) in enumerate(zip(mine["logged"], expected), 1):
        if not is_close(got, want, rel=1e-4):
            raise ExerciseFailed(f"at step {step} metrics.jsonl has optim/update_ratio {shown(got)}, "
                                 f"{compared(got, want)} ||W_after - W_before|| / ||W_before|| over all the "
                                 f"parameters: both norms are over every parameter together, the ratio taken once.")
    return (f"optim/update_ratio reached metrics.jsonl at every one of {len(expected)} steps with the right value, "
            f"from {expected[0]:.2g} at step 1 to {expected[-1]:.2g} at step {len(expected)} "
            f"(reduce={note['reduce']!r}).")
