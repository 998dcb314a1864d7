"""The checks of exercises 12 to 14: the AdamW update, gradient clipping and the ranks' split of a batch.

Each compares what the student's function did (run in the answer's process, grading.py) with what the project
uses, computed here: torch.optim.AdamW with its moment buffers, clip_grad_norm_, and data.TokenLoader.
"""

import os
import random
import tempfile

import torch

from exercises.grader.checking import ExerciseFailed, compared, is_close, shown
from exercises.grader.feed_core import adamw_answers, clipping_answers, ranks_answers

# ----------------------------------------------------------------------------- 12. AdamW


def torch_adamw(case):
    """What torch.optim.AdamW holds after each step: the weights and its two moment buffers."""
    reference = torch.nn.Parameter(case["param"].clone())
    optimizer = torch.optim.AdamW([reference], lr=case["lr"], betas=(case["beta1"], case["beta2"]), eps=case["eps"],
                                  weight_decay=case["weight_decay"], foreach=False)
    steps = []
    for grad in case["grads"]:
        reference.grad = grad.clone()
        optimizer.step()
        state = optimizer.state[reference]
        steps.append({"param": reference.detach().clone(), "exp_avg": state["exp_avg"].clone(),
                      "exp_avg_sq": state["exp_avg_sq"].clone()})
    return steps


def close(mine, want, terms=0.0):
    """Equal up to float32 rounding. An element that is a small difference of larger terms (exp_avg, where beta1 x
    exp_avg and (1 - beta1) x grad nearly cancel) is off by their rounding: the tolerance grows with `terms`, the
    largest such term."""
    return torch.is_tensor(mine) and mine.shape == want.shape and torch.allclose(mine, want, rtol=1e-5,
                                                                                 atol=1e-7 + 1e-6 * terms)


def adamw_advice(case, step, mine, want, before):
    """The sentence's end for the first thing of step `step` that differs from torch's, else None."""
    grad, wd, beta1 = case["grads"][step - 1], case["weight_decay"], case["beta1"]
    largest = max(g.abs().max().item() for g in case["grads"][:step])  # exp_avg mixes these gradients
    if torch.equal(mine["param"], before) and not torch.equal(want["param"], before):
        return ("your adamw_update left the weights as they were: update param in place (param.mul_, "
                "param.addcdiv_); `param = param - ...` only gives the name a new tensor, which the optimizer never "
                "sees")
    if not torch.equal(mine["grad"], grad):
        return "your update changed grad: torch's AdamW only reads it; work on copies (grad * ..., not grad.mul_)"
    # Adam with L2 only where exp_avg differs from torch's: when weight_decay x param is below the tolerance next
    # to the gradient (a tiny weight), the right exp_avg is close to both.
    with_l2, decay = (1 - beta1) * (grad + wd * case["param"]), wd * case["param"].abs().max().item()
    if step == 1 and wd and not close(mine["exp_avg"], want["exp_avg"], largest) and close(
            mine["exp_avg"], with_l2, largest + decay):
        return ("the weight decay is decoupled: the weights shrink by lr x weight_decay, apart from the gradient and "
                "its moments (adding weight_decay x param to the gradient is Adam with L2, another optimizer)")
    for name, formula, terms in (("exp_avg", "beta1 x exp_avg + (1 - beta1) x grad", largest),
                                 ("exp_avg_sq", "beta2 x exp_avg_sq + (1 - beta2) x grad^2", largest ** 2)):
        if not close(mine[name], want[name], terms):
            kept = ", updated in place (the next step reads it)" if not mine[name].abs().any() else ""
            return f"your {name} differs from torch's: it must become {formula}{kept}"
    if not close(mine["param"], want["param"]):
        coupled = "; the weight decay is decoupled: the weights shrink by lr x weight_decay" if wd else ""
        return (f"your weights differ from torch.optim.AdamW's by up to "
                f"{(mine['param'] - want['param']).abs().max().item():.3g}: check the bias corrections 1 - beta^step "
                f"and where eps goes{coupled}")
    return None


def check_adamw(answers):
    rng = random.Random(random.getrandbits(64))
    cases = []
    for _ in range(20):
        shape = (rng.randint(1, 5), rng.randint(1, 7))
        cases.append({"param": torch.randn(shape), "lr": 10 ** rng.uniform(-4, -1),
                      "weight_decay": rng.choice([0.0, 0.1, rng.random()]), "beta1": rng.choice([0.9, 0.8]),
                      "beta2": rng.choice([0.95, 0.999]), "eps": rng.choice([1e-8, 1e-6]),
                      "grads": [torch.randn(shape) * 10 ** rng.uniform(-3, 1) for _ in range(3)]})
    for case, steps in zip(cases, answers.run(adamw_answers, cases)):
        before = case["param"]
        for step, (mine, want) in enumerate(zip(steps, torch_adamw(case)), 1):
            advice = adamw_advice(case, step, mine, want, before)
            if advice:
                raise ExerciseFailed(f"after step {step} (lr {case['lr']:.3g}, betas {case['beta1']}, {case['beta2']}, "
                                     f"eps {case['eps']:g}, weight decay {case['weight_decay']:.3g}), {advice}.")
            before = mine["param"]
    return ("three steps of your update equal torch.optim.AdamW's, weights and both moments, on 20 random tensors "
            "and settings.")


# ----------------------------------------------------------------------------- 13. gradient clipping


def clipping_cases(rng):
    cases = []
    for case in range(20):
        shapes = [(rng.randint(1, 6), rng.randint(1, 6)) for _ in range(rng.randint(2, 5))]
        grads = [torch.randn(s) * 10 ** rng.uniform(-2, 1) for s in shapes]
        norms = [g.norm().item() for g in grads]
        total = torch.linalg.vector_norm(torch.tensor(norms)).item()
        # Above the limit, then below. Above, the largest tensor alone is over the limit too, so clipping each
        # tensor on its own gives tensors different factors, and the advice can say so every time.
        limit = max(norms) * rng.uniform(0.1, 0.9) if case % 2 == 0 else total * rng.uniform(1.1, 3)
        cases.append({"grads": grads, "limit": limit})
    return cases


def check_clipping(answers):
    cases = clipping_cases(random.Random(random.getrandbits(64)))
    for case, mine in zip(cases, answers.run(clipping_answers, cases)):
        theirs = [torch.nn.Parameter(torch.zeros(g.shape)) for g in case["grads"]]
        for p, g in zip(theirs, case["grads"]):
            p.grad = g.clone()
        want = torch.nn.utils.clip_grad_norm_(theirs, case["limit"]).item()
        if not is_close(mine["norm"], want, rel=1e-5):
            raise ExerciseFailed(f"clip_gradients returned {shown(mine['norm'])}, {compared(mine['norm'], want)} what "
                                 f"clip_grad_norm_ returns: the norm of all the gradients together before clipping.")
        above = "above" if want > case["limit"] else "below"
        factors = [(m.norm() / q.grad.norm()).item() if torch.is_tensor(m) else None
                   for m, q in zip(mine["grads"], theirs)]
        if any(not close(m, q.grad) for m, q in zip(mine["grads"], theirs)):
            if None in factors or max(factors) - min(factors) > 1e-4 * max(factors):
                advice = ("scale every gradient by one factor for all, max_norm / global norm, never each tensor by "
                          "its own")
            else:
                advice = "the one factor is max_norm / global norm, and only when that is below 1 (else leave them)"
            low, high = (f"{bound(f or 0 for f in factors):.3g}" for bound in (min, max))
            times = low if low == high else f"{low} to {high}"
            raise ExerciseFailed(f"with a global norm {above} the limit, your clipped gradients differ from "
                                 f"clip_grad_norm_'s (each tensor's norm is {times} times clip_grad_norm_'s): "
                                 f"{advice}.")
    return "your clipping equals clip_grad_norm_ on 20 random sets of gradients, above and below the limit."


# ----------------------------------------------------------------------------- 14. the ranks' split


def check_ranks(answers):
    import numpy as np

    from data import TokenLoader

    rng = random.Random(random.getrandbits(64))
    cases = []
    for _ in range(30):
        world_size, batch_size = rng.choice([1, 2, 3, 4, 8]), rng.randint(1, 6)
        cases.append((rng.randrange(0, 1000, world_size * batch_size), rng.randrange(world_size), world_size,
                      batch_size))
    cases.append((0, 1, 2, 3))  # a rank after the first, from the start
    mine = answers.run(ranks_answers, cases)
    with tempfile.TemporaryDirectory() as folder:
        np.save(os.path.join(folder, "train_000000.npy"), np.arange(20_000, dtype=np.uint16))
        for (position, rank, world_size, batch_size), got in zip(cases, mine):
            loader = TokenLoader(folder, "train", batch_size=batch_size, block_size=4, rank=rank,
                                 world_size=world_size)
            loader.position, read = position, []
            loader.sequence = lambda index, original=loader.sequence: read.append(index) or original(index)
            loader.next_batch()
            if not isinstance(got, (list, tuple)) or list(got) != read:
                advice = ("every rank reads the same sequences: offset them by the rank"
                          if rank and isinstance(got, (list, tuple)) and list(got) == [position + j for j in
                                                                                        range(batch_size)]
                          else "rank r reads the block of batch_size sequences after the r blocks of the ranks before "
                               "it")
                raise ExerciseFailed(f"rank {rank} of {world_size} at position {position} (batch_size {batch_size}) "
                                     f"reads {read}, and your rank_sequences gives {shown(got)}: {advice}.")
    return "your indices are the loader's at 30 random positions, batch sizes and world sizes."
