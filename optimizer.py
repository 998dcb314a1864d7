"""The optimizer and the learning-rate schedule.

optim.name=adamw: AdamW over every parameter (GPT-3, nanoGPT). optim.name=muon (the quick start's
config/shakespeare.py): Muon (Jordan et al. 2024; torch.optim.Muon) for the blocks' 2-D weights and
AdamW for the embeddings, the output layer, biases and gains, the split of modded-nanogpt,
nanochat's MuonAdamW and OLMo-core's muon ladder. The model says which parameter is what.

Muon orthogonalizes each matrix's momentum with a few Newton-Schulz iterations, so every direction
of the update moves by about the same amount. Moonshot's scaling (`adjust_lr_fn="match_rms_adamw"`;
Liu et al. 2025, "Muon is Scalable for LLM Training") gives its update AdamW's size, so both take
the same learning rate, as in OLMo-core's muon ladder; `optim.muon_lr` may set Muon's apart.

The loop asks `Schedule` for each step's LR, and `set_lr` applies it to each parameter group from
the group's own `peak_lr`.
"""

import itertools
import math
from dataclasses import dataclass

import torch

from config import ConfigError
from model import parameter_kinds


def param_groups(model, optim):
    """{group name: [parameters]} in the model's parameter order: which optimizer owns what (the dry
    run prints this). The model says what each parameter is, and its table (model.PARAM_KINDS) says
    whether that kind goes to Muon and takes weight decay. A kind's decay of None follows
    optim.decay_embeddings: false spares the embeddings (OLMo-core's ladder), and with them a tied
    output layer."""
    groups = {"muon": [], "decay": [], "no_decay": []}
    for name, p, kind in parameter_kinds(model):
        if not p.requires_grad:
            continue
        if optim.name == "muon" and kind.muon:
            if p.dim() != 2:  # torch.optim.Muon would fail on it mid-setup
                raise ConfigError(f"optim.name=muon steps {name}, a {p.dim()}-D parameter, as its "
                                  f"kind's row says, and Muon steps matrices only; give it a kind "
                                  f"whose row has muon=False, or use --optim.name=adamw.")
            groups["muon"].append(p)
        elif kind.decay or (kind.decay is None and optim.decay_embeddings):
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    return {name: group for name, group in groups.items() if group or name != "muon"}


def build_optimizer(model, optim, fused=False):
    """AdamW, or MuonAdamW, over `model` from the `optim` config section; `fused`: AdamW's kernel
    that updates all tensors in one launch, where the device table has it (devices.py)."""
    groups = param_groups(model, optim)
    adamw = torch.optim.AdamW(
        [{"params": groups["decay"], "weight_decay": optim.weight_decay, "name": "adamw",
          "peak_lr": optim.lr},
         {"params": groups["no_decay"], "weight_decay": 0.0, "name": "adamw_no_decay",
          "peak_lr": optim.lr}],
        lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
        **({"fused": True} if fused else {}))
    if optim.name == "adamw":
        return adamw
    muon_lr = optim.muon_lr or optim.lr
    muon = Muon([{"params": groups["muon"], "name": "muon", "peak_lr": muon_lr}], lr=muon_lr,
                weight_decay=optim.muon_weight_decay, momentum=optim.muon_momentum, nesterov=True,
                adjust_lr_fn="match_rms_adamw")
    return MuonAdamW(muon, adamw)


class Muon(torch.optim.Muon):
    """torch.optim.Muon, with its Newton-Schulz iterations in float32 on a CPU, and on FSDP's pieces
    of each matrix.

    torch iterates in bfloat16, which suits a GPU; a CPU without bfloat16 matrix units (AVX2)
    multiplies bfloat16 about 13x slower than float32 (docs/measurements.md). Under FSDP
    (train.data_parallel=fsdp) each rank holds a piece (a DTensor) of each matrix and of its
    gradient, already averaged, and keeps its piece of the elementwise momentum. Orthogonalising
    needs the whole matrix, so each rank all-gathers the update, orthogonalises it whole and applies
    its own rows: DDP's numbers (docs/fsdp.md says why, and what it costs). On a GPU without FSDP
    the step is torch's own; the state (`momentum_buffer`), the groups and the update rule always
    are."""

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        sharded = any(hasattr(p, "device_mesh") for p in params)  # DTensors
        on_gpu = any(p.device.type != "cpu" for p in params)
        if on_gpu and not sharded:
            return super().step(closure)
        loss = None
        if closure is not None:  # as torch's step: the closure recomputes the loss and gradients
            with torch.enable_grad():
                loss = closure()
        dtype = torch.bfloat16 if on_gpu else torch.float32
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                if sharded:  # every rank's piece gathered: the whole matrix
                    update = update.full_tensor()
                update = orthogonalize(update, group["ns_coefficients"], group["ns_steps"],
                                       group["eps"], dtype)
                if sharded:  # this rank's rows of it (cut locally: every rank has the whole)
                    from torch.distributed.tensor import distribute_tensor
                    update = distribute_tensor(update.to(p.dtype), p.device_mesh, p.placements,
                                               src_data_rank=None)
                p.mul_(1 - lr * group["weight_decay"])
                # Moonshot's scale (Liu et al. 2025): the update's RMS is AdamW's
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
        return loss


def orthogonalize(matrix, coefficients, steps, eps, dtype=torch.float32):
    """Newton-Schulz's quintic iteration (torch.optim.Muon's, Jordan et al. 2024) in `dtype`: the
    matrix with its singular values pushed to about 1 (0.5 to 1.5), its singular vectors kept."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    if x.size(0) > x.size(1):  # iterate on the wide side, where the Gram matrix x @ x.T is smaller
        x = x.T
    x = x / x.norm().clamp(min=eps)  # the spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if matrix.size(0) > matrix.size(1) else x


class MuonAdamW:
    """Muon and AdamW stepped as one optimizer (nanochat's MuonAdamW), so the loop, the checkpoint
    and the schedule see one object. DDP all-reduces the gradients before `step`, so every rank
    computes the same update of the whole matrix (under FSDP, of its piece)."""

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
    """Sets each group's LR at the schedule's point `lr` (of a curve that peaks at `peak_lr`),
    scaled to the group's own peak. Returns optim/lr/<group>, each group's LR read back from the
    optimizer, and optim/lr, the main AdamW group's: `lr` when the groups follow the config in
    force."""
    for group in optimizer.param_groups:
        group["lr"] = group["peak_lr"] * lr / peak_lr
    lrs = {f"optim/lr/{group['name']}": group["lr"] for group in optimizer.param_groups}
    return {"optim/lr": lrs["optim/lr/adamw"], **lrs}


# --------------------------------------------------------------------- the learning-rate schedule
# The LR of optimizer step n (1-based: the `optim/lr` logged at step n), by optim.schedule:
#     cosine    warmup, then cosine decay toward optim.min_lr (GPT-3; the default), as
#               build-nanogpt's get_lr: the curve reaches min_lr one step after the run's last
#     linear    warmup, then a straight line down to min_lr at the last step
#     constant  warmup, then optim.lr
#     wsd       warmup, stable at lr, then the last D steps decay to min_lr (Hägele et al. 2024)
#     wsds      Warmup-Stable-Decay-Simplified: periods of wsd, each back up to its peak (below)
# Warmup is optim.warmup_steps, or optim.warmup_fraction of the run (of P1 for wsds). The decay is
# optim.decay_steps, or optim.decay_fraction of the run (of each period for wsds), shaped by
# optim.decay_shape: s(x) = x (linear), (1 - cos(pi x)) / 2 (cosine) or 1 - sqrt(1 - x) (1-sqrt),
# as x falls from 1 to 0.


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
        if self.kind == "cosine":  # build-nanogpt's get_lr with it = n - 1
            progress = min(1.0, (n - 1 - W) / max(1, T - W))
            return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)
        if self.kind == "linear":
            return floor + (peak - floor) * max(0, T - n) / max(1, T - W)
        D = self.decay_steps[0]  # wsd
        if n >= T - D:
            return floor + (peak - floor) * self.decay_shape(max(0, T - n) / D) if D else floor
        return peak

    def decay_shape(self, x):
        """1 at the start of a decay (x = 1), 0 at its end (x = 0), by optim.decay_shape."""
        if self.shape == "linear":
            return x
        if self.shape == "cosine":
            return (1 - math.cos(math.pi * x)) / 2
        return 1 - math.sqrt(1 - x)  # 1-sqrt


def build_schedule(optim, total_steps):
    """The run's Schedule from `optim`; a combination that cannot work is one sentence."""
    o = optim
    if o.schedule == "wsds":
        return Schedule("wsds", o.lr, o.min_lr, total_steps, *schedule_fields(o, total_steps),
                        shape=o.decay_shape)
    warmup = o.warmup_steps or round(o.warmup_fraction * total_steps)
    decay = o.decay_steps or round(o.decay_fraction * total_steps)
    if o.schedule == "wsd" and warmup + decay > total_steps:
        raise ConfigError(f"optim.schedule=wsd: warmup ({warmup} steps) plus decay ({decay} steps) "
                          f"is longer than the run ({total_steps} steps); shorten one of them.")
    return Schedule(o.schedule, o.lr, o.min_lr, total_steps, warmup, (decay,), shape=o.decay_shape)


# -------------------------------------------------------------------------------- WSD-S's periods
# Warmup-Stable-Decay-Simplified (Wen et al. 2024; OLMo-core's WSDS): periods P1..Pk each hold their
# peak (lr x its multiplier) and decay to min_lr over their last D_i steps; the next period jumps
# back to its peak. The checkpoint at the bottom of each decay is a finished run of that length,
# which is what a model ladder measures.


def period_lr(schedule, n):
    """The LR of optimizer step n (1-based) of a wsds `schedule`."""
    start = 0
    for i, (length, D) in enumerate(zip(schedule.periods, schedule.decay_steps)):
        if n <= start + length:
            m, peak, floor = n - start, schedule.lr * schedule.multipliers[i], schedule.min_lr
            if i == 0 and m <= schedule.warmup_steps:
                return peak * m / schedule.warmup_steps
            if m >= length - D:
                return (floor + (peak - floor) * schedule.decay_shape((length - m) / D)
                        if D else floor)
            return peak
        start += length
    return schedule.min_lr  # after the last period


def period_ends(schedule):
    """The step at the bottom of each period's decay; none for another schedule."""
    return list(itertools.accumulate(schedule.periods))


def schedule_fields(optim, total_steps):
    """A wsds Schedule's (warmup_steps, decay_steps, periods, multipliers) from the `optim` section;
    periods that cannot work are one sentence."""
    o = optim
    if not o.periods:
        raise ConfigError("optim.schedule=wsds needs optim.periods, the length of each period in "
                          "steps (e.g. --optim.periods=1000,1000,2000).")
    first = o.periods[0]
    warmup = o.warmup_steps or round(o.warmup_fraction * first)
    decays = tuple(o.decay_steps or round(o.decay_fraction * p) for p in o.periods)
    if warmup + decays[0] > first:
        raise ConfigError(f"optim.schedule=wsds: warmup ({warmup} steps) plus the first decay "
                          f"({decays[0]} steps) is longer than the first period ({first} steps); "
                          f"shorten one of them.")
    if any(d > p for d, p in zip(decays, o.periods)):
        raise ConfigError(f"optim.decay_steps={o.decay_steps} is longer than a period "
                          f"({min(o.periods)} steps); lower it or use optim.decay_fraction.")
    if sum(o.periods) != total_steps:  # a checkpoint at each period's end is what WSD-S is for
        raise ConfigError(f"optim.periods={','.join(map(str, o.periods))} add up to "
                          f"{sum(o.periods)} steps but the run is {total_steps} steps "
                          f"(train.max_steps or train.max_duration); make them add up.")
    multipliers = tuple(o.period_lr_multipliers) or (1.0,) * len(o.periods)
    return warmup, decays, tuple(o.periods), multipliers
