"""The optimizer: AdamW over every parameter (GPT-3, nanoGPT; optim.name=adamw, the field's default), or, with
optim.name=muon (the quick start's config/shakespeare.py), Muon (Jordan et al. 2024; PyTorch's torch.optim.Muon) for
the blocks' 2-D weights beside AdamW for the embeddings, the output layer, biases and gains: the split of
modded-nanogpt, nanochat's MuonAdamW and OLMo-core's muon ladder (the model says which parameter is what).

Muon orthogonalizes each matrix's momentum with a few Newton-Schulz iterations, so every direction of the update
moves by about the same amount. With Moonshot's scaling (`adjust_lr_fn="match_rms_adamw"`, Liu et al. 2025, "Muon is
Scalable for LLM Training") its update has AdamW's size, so both take the same learning rate, as OLMo-core's muon
ladder does; `optim.muon_lr` may set Muon's apart. At the bottom: the learning-rate schedule (`Schedule`), which
the loop asks for the LR of each step and `set_lr` applies to each parameter group from the group's own `peak_lr`.
"""

import itertools
import math
from dataclasses import dataclass

import torch

from config import ConfigError
from model import parameter_kinds


def param_groups(model, optim):
    """{group name: [parameters]}: which optimizer owns what (the dry run prints this), in the model's parameter
    order, from what the model says each parameter is (`model.param_groups()`) and what its table says of that kind
    (model.PARAM_KINDS: Muon or AdamW, weight decay or not). A kind's decay of None follows optim.decay_embeddings:
    false spares the embeddings (OLMo-core's ladder), a tied output layer (the token embedding) with them."""
    groups = {"muon": [], "decay": [], "no_decay": []}
    for name, p, kind in parameter_kinds(model):
        if not p.requires_grad:
            continue
        if optim.name == "muon" and kind.muon:
            if p.dim() != 2:  # (Muon orthogonalises a matrix; torch.optim.Muon fails on anything else mid-setup)
                raise ConfigError(f"optim.name=muon steps {name}, a {p.dim()}-D parameter, as its kind's row says, and "
                                  f"Muon steps matrices only; give it a kind whose row has muon=False, or use "
                                  f"--optim.name=adamw.")
            groups["muon"].append(p)
        elif kind.decay or (kind.decay is None and optim.decay_embeddings):
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    return {name: group for name, group in groups.items() if group or name != "muon"}


def build_optimizer(model, optim, device_type):
    """AdamW, or MuonAdamW, over `model` from the `optim` config section."""
    groups = param_groups(model, optim)
    # The fused kernel updates all tensors in one launch on CUDA; it does not exist on CPU.
    fused = device_type == "cuda"
    adamw = torch.optim.AdamW(
        [{"params": groups["decay"], "weight_decay": optim.weight_decay, "name": "adamw", "peak_lr": optim.lr},
         {"params": groups["no_decay"], "weight_decay": 0.0, "name": "adamw_no_decay", "peak_lr": optim.lr}],
        lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **({"fused": True} if fused else {}))
    if optim.name == "adamw":
        return adamw
    muon_lr = optim.muon_lr or optim.lr
    muon = Muon([{"params": groups["muon"], "name": "muon", "peak_lr": muon_lr}], lr=muon_lr,
                weight_decay=optim.muon_weight_decay, momentum=optim.muon_momentum, nesterov=True,
                adjust_lr_fn="match_rms_adamw")
    return MuonAdamW(muon, adamw)


class Muon(torch.optim.Muon):
    """torch.optim.Muon, with its Newton-Schulz iterations in float32 on a CPU, and on FSDP's pieces of each matrix.

    torch iterates in bfloat16, which suits a GPU; a CPU without bfloat16 matrix units (AVX2) multiplies bfloat16
    about 13x slower than float32: Muon's step took 1.96x AdamW's at the quick start's shape, 1.03x in float32
    (docs/measurements.md). Under FSDP (train.data_parallel=fsdp) each rank holds a piece (a DTensor) of each matrix
    and of its gradient, already averaged (reduce-scattered), and keeps its piece of the elementwise momentum;
    orthogonalising needs the whole matrix, so each rank all-gathers the update (the momentum mixed with the
    gradient), orthogonalises it whole and applies its own rows: DDP's numbers (docs/fsdp.md: why gather, and what it
    costs). On a GPU without FSDP the step is torch's own; the state (`momentum_buffer`), the groups and the update
    rule always are."""

    @torch.no_grad()
    def step(self, closure=None):
        sharded = any(hasattr(p, "device_mesh") for group in self.param_groups for p in group["params"])  # DTensors
        on_gpu = any(p.device.type != "cpu" for group in self.param_groups for p in group["params"])
        if on_gpu and not sharded:
            return super().step(closure)
        loss = None
        if closure is not None:  # as torch's step: the closure recomputes the loss and its gradients
            with torch.enable_grad():
                loss = closure()
        # torch's GPU step orthogonalises in bfloat16; the CPU's in float32 (above)
        dtype = torch.bfloat16 if on_gpu else torch.float32
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                if sharded:  # every rank's piece gathered: the whole matrix (an all-gather)
                    update = update.full_tensor()
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                if sharded:  # this rank's rows of it (cut locally: every rank has the whole)
                    from torch.distributed.tensor import distribute_tensor
                    update = distribute_tensor(update.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
                p.mul_(1 - lr * group["weight_decay"])
                # Moonshot's scale (adjust_lr_fn="match_rms_adamw", Liu et al. 2025): the update's RMS is AdamW's
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
        return loss


def orthogonalize(matrix, coefficients, steps, eps, dtype=torch.float32):
    """Newton-Schulz's quintic iteration (torch.optim.Muon's, Jordan et al. 2024) in `dtype`: the matrix with its
    singular values pushed to about 1 (0.5 to 1.5), its singular vectors kept."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    if x.size(0) > x.size(1):  # iterate on the wide side: the Gram matrix x @ x.T is the smaller square
        x = x.T
    x = x / x.norm().clamp(min=eps)  # the spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if matrix.size(0) > matrix.size(1) else x


class MuonAdamW:
    """Muon and AdamW stepped as one optimizer (nanochat's MuonAdamW): the loop, the checkpoint and the
    schedule see one object. Gradients are all-reduced by DDP before `step`, so every rank computes the
    same update of the whole matrix (under FSDP, of its piece: Muon above)."""

    name = "muon"  # optim.name: what a checkpoint's optimizer state belongs to

    def __init__(self, muon, adamw):
        self.optimizers = {"muon": muon, "adamw": adamw}

    @property
    def param_groups(self):
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def step(self):
        for optimizer in self.optimizers.values():
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {name: optimizer.state_dict() for name, optimizer in self.optimizers.items()}

    def load_state_dict(self, state):
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state[name])


def set_lr(optimizer, lr, peak_lr):
    """The schedule's LR for this step (`lr`, of a schedule peaking at `peak_lr`) applied to every group, each from
    its own peak along the same curve. Returns optim/lr/<group>, each group's LR read back from the optimizer, and
    optim/lr, the main AdamW group's (the schedule's LR when the config in force is what the optimizer uses)."""
    for group in optimizer.param_groups:
        group["lr"] = group["peak_lr"] * lr / peak_lr
    lrs = {f"optim/lr/{group['name']}": group["lr"] for group in optimizer.param_groups}
    return {"optim/lr": lrs["optim/lr/adamw"], **lrs}


# ----------------------------------------------------------------------------- the learning-rate schedule
# The LR of optimizer step n (1-based: the `optim/lr` logged at step n), by optim.schedule:
#     cosine    warmup, then cosine decay toward optim.min_lr (GPT-3; the default), as build-nanogpt's get_lr: the
#               curve reaches min_lr one step after the run's last (the quick start's last LR is 2.0001e-4, not 2e-4)
#     linear    warmup, then a straight line down to min_lr at the last step
#     constant  warmup, then optim.lr
#     wsd       warmup, stable at lr, then a decay over the last D steps to min_lr (Hägele et al. 2024)
#     wsds      Warmup-Stable-Decay-Simplified (Wen et al. 2024; OLMo-core's WSDS): periods P1..Pk, each a wsd from
#               its peak (lr x its multiplier) to min_lr, then back up (below); the bottom of each decay is a finished
#               run of that length, which is what a model ladder measures
# Warmup is optim.warmup_steps, or optim.warmup_fraction of the run (of P1 for wsds); the decay optim.decay_steps, or
# optim.decay_fraction of the run (of each period for wsds), shaped by optim.decay_shape: s(x) = x (linear),
# (1 - cos(pi x)) / 2 (cosine) or 1 - sqrt(1 - x) (1-sqrt), as x falls from 1 to 0 (`Schedule.decay_shape`).


@dataclass(frozen=True)
class Schedule:
    kind: str  # optim.schedule
    lr: float  # peak
    min_lr: float  # floor
    total_steps: int  # T, the run's length
    warmup_steps: int  # W
    decay_steps: tuple  # D for wsd: (D,); for wsds one per period
    periods: tuple = ()  # wsds: period lengths P1..Pk
    multipliers: tuple = ()  # wsds: the peak of period i is lr x multipliers[i]
    shape: str = "linear"  # decay shape for wsd and wsds

    def lr_at(self, n):
        """The learning rate of optimizer step n (1-based)."""
        if self.kind == "wsds":
            return period_lr(self, n)
        T, W, peak, floor = self.total_steps, self.warmup_steps, self.lr, self.min_lr
        if n <= W:
            return peak * n / W
        if self.kind == "constant":
            return peak
        if self.kind == "cosine":  # build-nanogpt's get_lr with it = n - 1: progress from the end of warmup
            progress = min(1.0, (n - 1 - W) / max(1, T - W))
            return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)
        if self.kind == "linear":
            return floor + (peak - floor) * max(0, T - n) / max(1, T - W)
        D = self.decay_steps[0]  # wsd
        if n >= T - D:
            return floor + (peak - floor) * self.decay_shape(max(0, T - n) / D) if D else floor
        return peak

    def decay_shape(self, x):
        """1 at the start of a decay (x = 1), 0 at its end (x = 0): linear, cosine or 1-sqrt (optim.decay_shape)."""
        if self.shape == "linear":
            return x
        if self.shape == "cosine":
            return (1 - math.cos(math.pi * x)) / 2
        return 1 - math.sqrt(1 - x)  # 1-sqrt


def build_schedule(optim, total_steps):
    """The run's Schedule from the `optim` section; a combination that cannot work is one sentence."""
    o = optim
    if o.schedule == "wsds":
        return Schedule("wsds", o.lr, o.min_lr, total_steps, *schedule_fields(o, total_steps), shape=o.decay_shape)
    warmup = o.warmup_steps or round(o.warmup_fraction * total_steps)
    decay = o.decay_steps or round(o.decay_fraction * total_steps)
    if o.schedule == "wsd" and warmup + decay > total_steps:
        raise ConfigError(f"optim.schedule=wsd: warmup ({warmup} steps) plus decay ({decay} steps) is longer than "
                          f"the run ({total_steps} steps); shorten one of them.")
    return Schedule(o.schedule, o.lr, o.min_lr, total_steps, warmup, (decay,), shape=o.decay_shape)


# ----------------------------------------------------------------------------- WSD-S's periods
# Warmup-Stable-Decay-Simplified (Wen et al. 2024; OLMo-core's WSDS): periods P1..Pk each hold their peak (lr x its
# multiplier) and decay over their last D_i steps to min_lr; the next period jumps back to its peak. The checkpoint at
# each decay's bottom is a finished run of that length, which is what a model ladder measures (`period_ends`).


def period_lr(schedule, n):
    """The LR of optimizer step n (1-based) of a wsds `schedule` (optimizer.Schedule)."""
    start = 0
    for i, (length, D) in enumerate(zip(schedule.periods, schedule.decay_steps)):
        if n <= start + length:
            m, peak, floor = n - start, schedule.lr * schedule.multipliers[i], schedule.min_lr
            if i == 0 and m <= schedule.warmup_steps:
                return peak * m / schedule.warmup_steps
            if m >= length - D:
                return floor + (peak - floor) * schedule.decay_shape((length - m) / D) if D else floor
            return peak
        start += length
    return schedule.min_lr  # after the last period


def period_ends(schedule):
    """The step at the bottom of each period's decay (a finished run of that length); none for another schedule."""
    return list(itertools.accumulate(schedule.periods))


def schedule_fields(optim, total_steps):
    """A wsds Schedule's (warmup_steps, decay_steps, periods, multipliers) from the `optim` section: the warmup, each
    period's decay, length and LR multiplier. Periods that cannot work are one sentence."""
    o = optim
    if not o.periods:
        raise ConfigError("optim.schedule=wsds needs optim.periods, the length of each period in steps "
                          "(e.g. --optim.periods=1000,1000,2000).")
    first = o.periods[0]
    warmup = o.warmup_steps or round(o.warmup_fraction * first)
    decays = tuple(o.decay_steps or round(o.decay_fraction * p) for p in o.periods)
    if warmup + decays[0] > first:
        raise ConfigError(f"optim.schedule=wsds: warmup ({warmup} steps) plus the first decay ({decays[0]} steps) "
                          f"is longer than the first period ({first} steps); shorten one of them.")
    if any(d > p for d, p in zip(decays, o.periods)):
        raise ConfigError(f"optim.decay_steps={o.decay_steps} is longer than a period ({min(o.periods)} steps); "
                          f"lower it or use optim.decay_fraction.")
    if sum(o.periods) != total_steps:  # a checkpoint at each period's end is what a WSD-S run is for
        raise ConfigError(f"optim.periods={','.join(map(str, o.periods))} add up to {sum(o.periods)} steps but the "
                          f"run is {total_steps} steps (train.max_steps or train.max_duration); make them add up.")
    return warmup, decays, tuple(o.periods), tuple(o.period_lr_multipliers) or (1.0,) * len(o.periods)
