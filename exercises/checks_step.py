"""The checks of exercises 1 to 5: one training step, from its learning rate to the metrics it logs.

Each compares the student's answers with the project's code (checking.py says how a check works):
1 the schedule (optimizer.py), 2 gradient accumulation (train.py's train_step), 3 the causal mask
(model.py's CausalSelfAttention), 4 FLOPs and MFU (model.py, callbacks.py), 5 a new metric through
the real loop (metrics.py's MetricRecorder).
"""

import math
import random
import tempfile
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from config import OptimConfig
from exercises.checking import (ExerciseFailed, TINY_RUN, host_syncs, is_close, patched, run_training, shown,
                                tiny_gpt)
from model import GPT, CausalSelfAttention, GPTConfig

# ----------------------------------------------------------------------------- 1. the schedule


def schedule_phase(schedule, n):
    """The part of the schedule that step n is in, as the place to look."""
    T, W, D = schedule.total_steps, schedule.warmup_steps, schedule.decay_steps[0]
    if n <= W:
        return f"the warmup (steps 1 to {W})"
    if schedule.kind == "cosine":
        return f"the cosine decay (steps {W + 1} to {T}; its progress is 0 at step {W + 1})"
    if n < T - D:
        return f"the stable part (steps {W + 1} to {T - D - 1})"
    return f"the decay (steps {T - D} to {T}, x = (T - n) / D)"


def check_schedule(answers):
    from optimizer import build_schedule

    rng = random.Random()  # fresh every time: an answer cannot be fitted to fixed inputs
    count = 0
    for i in range(60):
        kind, total = ("wsd" if i == 0 else rng.choice(["cosine", "wsd"])), rng.randint(10, 3000)
        warmup = rng.randint(0, total // 4)
        # The first is a WSD schedule without decay steps (decay_steps=0 and decay_fraction=0 are allowed).
        decay, shape = (0 if i == 0 else rng.randint(1, total - warmup)), rng.choice(["linear", "cosine", "1-sqrt"])
        peak = 10 ** rng.uniform(-4, -2)
        optim = OptimConfig(schedule=kind, lr=peak, min_lr=peak * rng.choice([0.0, 0.1, rng.random()]),
                            warmup_steps=warmup, decay_steps=decay, decay_fraction=0.1 if decay else 0.0,
                            decay_shape=shape)
        schedule = build_schedule(optim, total)
        T, W, D = schedule.total_steps, schedule.warmup_steps, schedule.decay_steps[0]
        edges = {1, W, W + 1, W + 2, T - D - 1, T - D, T - D + 1, T - 1, T}
        steps = sorted({n for n in edges if 1 <= n <= T} | {rng.randint(1, T) for _ in range(20)})
        for n in steps:
            mine, want = answers.lr_at(schedule, n), schedule.lr_at(n)
            if not is_close(mine, want):
                described = (f"a {kind} schedule of {T} steps (peak {schedule.lr:.3g}, floor {schedule.min_lr:.3g}, "
                             f"warmup {W}" + (f", {shape} decay over the last {D})" if kind == "wsd" else ")"))
                mine, want = shown(mine, want)
                raise ExerciseFailed(f"lr_at(step {n}) of {described} is {mine} where the project's schedule gives "
                                     f"{want}: check {schedule_phase(schedule, n)}.")
        count += len(steps)
    return f"lr_at matches schedule.py at {count} steps of 60 random cosine and WSD schedules."


# ----------------------------------------------------------------------------- 2. gradient accumulation


class ListLoader:
    """Hands out fixed (x, y) micro-batches: all that train_step needs of a loader."""
    device = "cpu"

    def __init__(self, batches):
        self.batches = list(batches)

    def next_batch(self):
        return self.batches.pop(0)


class GradientKeeper:
    """Stands in for the optimizer in train_step: keeps the gradients it would have stepped with."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = gradients(self.model)

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def gradients(model):
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}


def largest_difference(mine, want):
    """(name, relative difference) of the gradient that differs most, relative to its own norm."""
    errors = {name: ((mine[name] - want[name]).norm() / want[name].norm().clamp_min(1e-12)).item() for name in want}
    name = max(errors, key=errors.get)
    return name, errors[name]


def global_norm(grads):
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()


def check_accumulation(answers):
    from train import train_step

    for micro_steps in (2, 3, 4):
        seed, size, length = random.randrange(2**31), random.randint(1, 3), random.randint(4, 16)
        tokens = torch.randint(0, 512, (micro_steps * size, length + 1), generator=torch.Generator().manual_seed(seed))
        x, y = tokens[:, :-1], tokens[:, 1:]
        micro_batches = [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(micro_steps)]

        whole = tiny_gpt(seed)  # the definition: one forward and backward pass over the whole batch
        whole_loss = whole(x, y)
        whole_loss.backward()
        want = gradients(whole)
        # What the student's answer must equal, two ways the project gets it: DDP's ranks each take one
        # micro-batch and average their gradients; train_step takes them one after another on one rank.
        ranks = [tiny_gpt(seed) for _ in micro_batches]
        for model, (xi, yi) in zip(ranks, micro_batches):
            model(xi, yi).backward()
        averaged = {name: sum(gradients(model)[name] for model in ranks) / micro_steps for name in want}
        project = tiny_gpt(seed)
        keeper = GradientKeeper(project)
        train_step(project, keeper, ListLoader(micro_batches), micro_steps, nullcontext(), grad_clip=0.0,
                   nan_policy="stop")
        for label, grads in (("averaging over ranks", averaged), ("train.py's train_step", keeper.grads)):
            name, error = largest_difference(grads, want)
            assert error < 1e-4, f"{label} differs from one big batch at {name} by {error:.2e}"

        student = tiny_gpt(seed)
        loss = answers.accumulate_gradients(student, micro_batches)
        mine = gradients(student)
        missing = [name for name, g in mine.items() if g is None]
        if missing:
            raise ExerciseFailed(f"after accumulate_gradients, {missing[0]} has no gradient: call backward() on every "
                                 f"micro-step's loss.")
        ratio = global_norm(mine) / global_norm(want)
        name, error = largest_difference(mine, want)
        if error > 1e-4:
            if abs(ratio - micro_steps) < 0.01 * micro_steps:
                advice = "divide each micro-step's loss by the number of micro-steps before backward()"
            elif abs(ratio * micro_steps - 1) < 0.01:
                advice = "the loss is divided by the number of micro-steps twice"
            else:
                advice = "each micro-step must add its share (loss / micro-steps) into .grad, no zero_grad in between"
            raise ExerciseFailed(f"with {micro_steps} micro-steps your gradient is {ratio:.3g} times as large as one "
                                 f"pass over the whole batch gives, and {name}'s differs by {error:.1%}: {advice}.")
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ExerciseFailed(f"accumulate_gradients returned {type(loss).__name__} {loss!r}; return the mean loss "
                                 f"as a one-number tensor.")
        if loss.requires_grad:
            raise ExerciseFailed("the loss you return still holds its graph (requires_grad): return loss.detach(), "
                                 "or every micro-step's activations stay in memory until the step ends.")
        if not is_close(loss.item(), whole_loss.item(), rel=1e-5):
            raise ExerciseFailed(f"with {micro_steps} micro-steps you return the loss {loss.item():.6g} where the mean "
                                 f"over the whole batch is {whole_loss.item():.6g}: average the micro-steps' losses.")
    return ("accumulate_gradients matches one pass over the whole batch with 2, 3 and 4 micro-steps, as train.py's "
            "train_step and ranks averaging their gradients (DDP) do.")


# ----------------------------------------------------------------------------- 3. the causal mask


def attention_without_scaling(attn, x):
    """What forward would give without dividing the scores by sqrt(head size): a mistake to recognise."""
    B, T, C = x.size()
    q, k, v = (t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, C))


def check_attention(answers):
    for _ in range(8):
        heads, head_size = random.choice([1, 2, 4]), random.choice([4, 8, 16])
        batch, length, width = random.randint(1, 3), random.randint(2, 12), heads * head_size
        torch.manual_seed(random.randrange(2**31))
        attn = CausalSelfAttention(GPTConfig(n_embd=width, n_head=heads, block_size=length)).eval()
        x = torch.randn(batch, length, width)
        changed = x.clone()
        changed[:, -1] += torch.randn(batch, width)  # only the last token differs
        with torch.no_grad():
            want, unscaled = attn(x), attention_without_scaling(attn, x)
            mine = answers.causal_self_attention(attn, x)
            mine_changed = answers.causal_self_attention(attn, changed)
        sizes = f"(n_head {heads}, head size {head_size}, {length} tokens)"
        if not torch.is_tensor(mine) or mine.shape != want.shape:
            raise ExerciseFailed(f"your output has shape {tuple(getattr(mine, 'shape', ()))} where forward's is "
                                 f"{tuple(want.shape)} {sizes}: put the heads back side by side and apply attn.c_proj.")
        if torch.isnan(mine).any():
            position = torch.isnan(mine).any(-1).any(0).nonzero()[0].item()
            raise ExerciseFailed(f"your output is NaN at position {position} {sizes}: a softmax over scores that are "
                                 f"all -inf; every position must see itself (keep the diagonal of the mask).")
        leaks = (mine_changed[:, :-1] - mine[:, :-1]).abs().amax(dim=(0, 2)) > 1e-6
        if leaks.any():
            raise ExerciseFailed(f"the output at position {leaks.nonzero()[0].item()} changes when only the last token "
                                 f"(position {length - 1}) changes {sizes}: mask the future, the scores above the "
                                 f"diagonal, with -inf before the softmax.")
        if not torch.allclose(mine, want, rtol=1e-4, atol=1e-5):
            position = ((mine - want).abs().amax(dim=(0, 2)) > 1e-5).nonzero()[0].item()
            advice = ("divide the scores by sqrt(head size) before the softmax"
                      if torch.allclose(mine, unscaled, rtol=1e-4, atol=1e-5)
                      else "check each step against the hint (the split into heads, the softmax over the keys)")
            raise ExerciseFailed(f"your output differs from CausalSelfAttention.forward's by up to "
                                 f"{(mine - want).abs().max().item():.3g} from position {position} on {sizes}: "
                                 f"{advice}.")
    return ("causal_self_attention matches CausalSelfAttention.forward on 8 random shapes, and no token sees a "
            "later one.")


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
    from callbacks import speed_metrics

    configs = [GPTConfig()]  # GPT-2 (124M) first, then random shapes
    for _ in range(12):
        heads = random.randint(1, 16)
        configs.append(GPTConfig(n_layer=random.randint(1, 12), n_head=heads,
                                 n_embd=heads * random.choice([16, 32, 64, 128]),
                                 block_size=random.choice([16, 128, 1024, 2048]),
                                 vocab_size=random.randint(100, 60000)))
    for c in configs:
        with torch.device("meta"):  # shapes only: even a large model costs no memory
            model = GPT(c)
        mine, want = answers.flops_per_token(model), model.flops_per_token()
        if not is_close(mine, want):
            try:
                advice = flops_advice(c, want - float(mine))
            except (TypeError, ValueError):
                advice = "return the count as a number"
            mine = f"{mine:,}" if isinstance(mine, int) else repr(mine)
            raise ExerciseFailed(f"flops_per_token is {mine} where GPT.flops_per_token gives {want:,} for "
                                 f"n_layer {c.n_layer}, n_embd {c.n_embd}, block_size {c.block_size}, vocab_size "
                                 f"{c.vocab_size}: {advice}.")
    for _ in range(20):
        flops, tokens_per_step, seconds = random.uniform(1e5, 1e10), random.randint(1, 10**6), random.uniform(1e-3, 10)
        world_size, peak = random.randint(1, 64), random.uniform(1e11, 1e16)
        want = speed_metrics(step_time=seconds, data_time=0.0, tokens_per_step=tokens_per_step, block_size=1,
                             tokens_seen=tokens_per_step, flops_per_token=flops, world_size=world_size,
                             peak_flops=peak)["throughput/mfu"]
        mine = answers.mfu(flops, tokens_per_step / seconds, world_size, peak)
        if not is_close(mine, want):
            if is_close(mine, want * world_size):
                advice = "tokens_per_sec counts every rank together and MFU is per device: divide by world_size"
            elif is_close(mine, want * 100):
                advice = "MFU is a fraction between 0 and 1, not a percentage"
            else:
                advice = "MFU is the model's FLOP/s per device over one device's peak"
            mine, want = shown(mine, want)
            raise ExerciseFailed(f"mfu is {mine} where callbacks.speed_metrics gives {want} for {flops:.4g} FLOPs per "
                                 f"token, {tokens_per_step / seconds:.4g} tokens/s on {world_size} device(s) of "
                                 f"{peak:.4g} FLOP/s: {advice}.")
    with torch.device("meta"):
        gpt2 = answers.flops_per_token(GPT(GPTConfig()))
    h100 = answers.mfu(gpt2, 560_104, 1, 989e12)  # README.md's measured speed on one H100 (docs/measurements.md)
    return (f"flops_per_token matches model.py on 13 shapes and mfu matches callbacks.py; GPT-2 (124M) costs "
            f"{gpt2:,} FLOPs per token, so README.md's 560,104 tokens/s on one H100 (989 TFLOP/s) is {h100:.1%} MFU.")


# ----------------------------------------------------------------------------- 5. a new metric


def update_ratio(model, weights_before):
    """||W_after - W_before|| / ||W_before|| over every parameter together: the check's own value."""
    change = sum(((p.detach() - weights_before[name]) ** 2).sum() for name, p in model.named_parameters())
    size = sum((weights_before[name] ** 2).sum() for name, _ in model.named_parameters())
    return (change / size).sqrt().item()


class RecorderSpy:
    """The run's MetricRecorder as the student's function sees it: it notes what is recorded, and how."""

    def __init__(self, recorder, notes):
        self.recorder, self.notes = recorder, notes

    def record_metric(self, name, value, reduce="mean", merge="warn"):
        self.notes.append((name, value, reduce))
        self.recorder.record_metric(name, value, reduce, merge)

    def record_all(self, values, reduce="mean"):
        for name, value in values.items():
            self.record_metric(name, value, reduce)


def check_metric(answers, data_root=""):
    import train

    original_build_run, original_train_step = train.build_run, train.train_step
    runs, expected, notes = [], [], []

    def build_run(cfg, stack):  # the same run, kept to reach its recorder
        runs.append(original_build_run(cfg, stack))
        return runs[-1]

    def train_step(model, optimizer, loader, *args, **kwargs):  # the project's step, then the student's metric
        raw_model = runs[-1].raw_model
        before = {name: p.detach().clone() for name, p in raw_model.named_parameters()}
        result = original_train_step(model, optimizer, loader, *args, **kwargs)
        expected.append(update_ratio(raw_model, before))
        with host_syncs() as syncs:
            answers.record_update_ratio(RecorderSpy(runs[-1].recorder, notes), raw_model, before)
        if syncs:
            raise ExerciseFailed(f"your record_update_ratio calls .{syncs[0].strip('_')}() on a tensor, which makes "
                                 f"the host wait for the device every step on a GPU: keep every sum on tensors "
                                 f"(torch.stack, torch.linalg.vector_norm) and record the tensor itself.")
        return result

    with tempfile.TemporaryDirectory() as out, patched(train, "build_run", build_run), \
            patched(train, "train_step", train_step):
        rows = run_training(TINY_RUN + [f"--data.data_root={data_root}", f"--train.out_dir={out}",
                                        "--train.max_steps=6", "--eval.interval=0", "--train.no_checkpoints=true",
                                        "--log.metrics_collect_interval=3"])
    names = sorted({name for name, _, _ in notes})
    if "optim/update_ratio" not in names:
        raise ExerciseFailed(f"you recorded {', '.join(names)} but the check looks for optim/update_ratio: record it "
                             f"under that name." if names else "record_update_ratio recorded nothing: call "
                             "recorder.record_metric(\"optim/update_ratio\", ratio, reduce=...).")
    _, value, reduce = next(note for note in notes if note[0] == "optim/update_ratio")
    if not torch.is_tensor(value):
        raise ExerciseFailed(f"you recorded a Python {type(value).__name__}, and making one (.item(), float()) makes "
                             f"the host wait for the device every step on a GPU: record the tensor itself.")
    if reduce in ("sum", "l2_norm"):
        raise ExerciseFailed(f"you recorded it with reduce={reduce!r}, which on 2 ranks logs "
                             f"{'twice' if reduce == 'sum' else 'sqrt(2) times'} the ratio, as every rank holds the "
                             f"same weights: use reduce=\"mean\" (or \"max\", or None for rank 0's value).")
    for step, want in enumerate(expected, 1):
        got = rows[step - 1].get("optim/update_ratio")
        if not is_close(got, want, rel=1e-4):
            got, want = shown(got, want)
            raise ExerciseFailed(f"at step {step} metrics.jsonl has optim/update_ratio {got} where ||W_after - "
                                 f"W_before|| / ||W_before|| over all the parameters is {want}: both norms are over "
                                 f"every parameter together, the ratio taken once.")
    return (f"optim/update_ratio reached metrics.jsonl at every one of {len(expected)} steps with the right value, "
            f"from {expected[0]:.2g} at step 1 to {expected[-1]:.2g} at step {len(expected)} (reduce={reduce!r}).")
