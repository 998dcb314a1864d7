"""The checks of exercises 1 to 3: one training step, its learning rate, its accumulation, its attention.

Each compares the student's answers with the project's code (checking.py says how a check works, and
grading.py how the answer runs apart): 1 the schedule (optimizer.py), 2 gradient accumulation (train.py's
train_step), 3 the causal mask (model.py's CausalSelfAttention).
"""

import random
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from exercises.grader.checking import ExerciseFailed, compared, gradients, is_close, shown, tiny_gpt
from exercises.grader.feed_step import (accumulation_answers, attention_answers, attention_module, build_schedule,
                                 micro_batches_of, schedule_answers)

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
    rng = random.Random(random.getrandbits(64))  # fresh every time: an answer cannot be fitted to fixed inputs
    cases = []
    for i in range(60):
        kind, total = ("wsd" if i == 0 else rng.choice(["cosine", "wsd"])), rng.randint(10, 3000)
        warmup = rng.randint(0, total // 4)
        # The first is a WSD schedule without decay steps (decay_steps=0 and decay_fraction=0 are allowed).
        decay, shape = (0 if i == 0 else rng.randint(1, total - warmup)), rng.choice(["linear", "cosine", "1-sqrt"])
        peak = 10 ** rng.uniform(-4, -2)
        case = {"optim": dict(schedule=kind, lr=peak, min_lr=peak * rng.choice([0.0, 0.1, rng.random()]),
                              warmup_steps=warmup, decay_steps=decay, decay_fraction=0.1 if decay else 0.0,
                              decay_shape=shape), "total": total}
        schedule = build_schedule(case)
        T, W, D = schedule.total_steps, schedule.warmup_steps, schedule.decay_steps[0]
        edges = {1, W, W + 1, W + 2, T - D - 1, T - D, T - D + 1, T - 1, T}
        case["steps"] = sorted({n for n in edges if 1 <= n <= T} | {rng.randint(1, T) for _ in range(20)})
        cases.append(case)
    results = answers.run(schedule_answers, cases)
    for case, values in zip(cases, results):
        schedule = build_schedule(case)
        for n, mine in zip(case["steps"], values):
            want = schedule.lr_at(n)
            if not is_close(mine, want):
                T, W, D = schedule.total_steps, schedule.warmup_steps, schedule.decay_steps[0]
                described = (f"a {schedule.kind} schedule of {T} steps (peak {schedule.lr:.3g}, floor "
                             f"{schedule.min_lr:.3g}, warmup {W}"
                             + (f", {schedule.shape} decay over the last {D})" if schedule.kind == "wsd" else ")"))
                raise ExerciseFailed(f"lr_at(step {n}) of {described} is {shown(mine)}, {compared(mine, want)} what "
                                     f"the project's schedule gives: check {schedule_phase(schedule, n)}.")
    return f"lr_at matches optimizer.py's Schedule.lr_at at {sum(len(c['steps']) for c in cases)} steps of 60 random " \
           f"cosine and WSD schedules."


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


def largest_difference(mine, want):
    """(name, relative difference) of the gradient that differs most, relative to its own norm."""
    errors = {name: ((mine[name] - want[name]).norm() / want[name].norm().clamp_min(1e-12)).item() for name in want}
    name = max(errors, key=errors.get)
    return name, errors[name]


def global_norm(grads):
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()


def check_accumulation(answers):
    from train import train_step

    cases = []
    for micro_steps in (2, 3, 4):
        seed, size, length = random.randrange(2**31), random.randint(1, 3), random.randint(4, 16)
        tokens = torch.randint(0, 512, (micro_steps * size, length + 1), generator=torch.Generator().manual_seed(seed))
        cases.append({"micro_steps": micro_steps, "seed": seed, "size": size, "tokens": tokens})
    running = answers.start(accumulation_answers, cases)
    wants = []
    for case in cases:
        micro_batches, micro_steps = micro_batches_of(case), case["micro_steps"]
        whole = tiny_gpt(case["seed"])  # the definition: one forward and backward pass over the whole batch
        whole_loss = whole(case["tokens"][:, :-1], case["tokens"][:, 1:])
        whole_loss.backward()
        want = gradients(whole)
        # What the student's answer must equal, two ways the project gets it: DDP's ranks each take one
        # micro-batch and average their gradients; train_step takes them one after another on one rank.
        ranks = [tiny_gpt(case["seed"]) for _ in micro_batches]
        for model, (xi, yi) in zip(ranks, micro_batches):
            model(xi, yi).backward()
        averaged = {name: sum(gradients(model)[name] for model in ranks) / micro_steps for name in want}
        project = tiny_gpt(case["seed"])
        keeper = GradientKeeper(project)
        train_step(project, keeper, ListLoader(micro_batches), micro_steps, nullcontext(), grad_clip=0.0)
        for label, grads in (("averaging over ranks", averaged), ("train.py's train_step", keeper.grads)):
            name, error = largest_difference(grads, want)
            assert error < 1e-4, f"{label} differs from one big batch at {name} by {error:.2e}"
        wants.append((want, whole_loss.item()))
    for case, (want, whole_loss), mine in zip(cases, wants, running.result()):
        micro_steps, loss = case["micro_steps"], mine["loss"]
        missing = [name for name, g in mine["grads"].items() if g is None]
        if missing:
            raise ExerciseFailed(f"after accumulate_gradients, {missing[0]} has no gradient: call backward() on every "
                                 f"micro-step's loss.")
        ratio = global_norm(mine["grads"]) / global_norm(want)
        name, error = largest_difference(mine["grads"], want)
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
            raise ExerciseFailed(f"accumulate_gradients returned {shown(loss)}; return the mean loss as a "
                                 f"one-number tensor.")
        if mine["keeps_graph"]:
            raise ExerciseFailed("the loss you return still holds its graph (requires_grad): return loss.detach(), "
                                 "or every micro-step's activations stay in memory until the step ends.")
        if not is_close(loss.item(), whole_loss, rel=1e-5):
            raise ExerciseFailed(f"with {micro_steps} micro-steps you return the loss {loss.item():.6g}, "
                                 f"{compared(loss.item(), whole_loss)} the mean over the whole batch: average the "
                                 f"micro-steps' losses.")
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
    from model import CausalSelfAttention, GPTConfig

    cases = []
    for _ in range(8):
        heads, head_size = random.choice([1, 2, 4]), random.choice([4, 8, 16])
        batch, length, width = random.randint(1, 3), random.randint(2, 12), heads * head_size
        torch.manual_seed(random.randrange(2**31))
        attn = CausalSelfAttention(GPTConfig(n_embd=width, n_head=heads, block_size=length))
        x = torch.randn(batch, length, width)
        changed = x.clone()
        changed[:, -1] += torch.randn(batch, width)  # only the last token differs
        cases.append({"heads": heads, "width": width, "length": length, "weights": attn.state_dict(), "x": x,
                      "changed": changed})
    for case, (mine, mine_changed) in zip(cases, answers.run(attention_answers, cases)):
        attn, x, length = attention_module(case), case["x"], case["length"]
        with torch.no_grad():
            want, unscaled = attn(x), attention_without_scaling(attn, x)
        sizes = f"(n_head {case['heads']}, head size {case['width'] // case['heads']}, {length} tokens)"
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
