"""The run configurator: batch, learning rate, schedule, duration and checkpoints from the model
size.

OLMo-core's `WSDSChinchillaRunConfigurator` (the GPU dial's rules), with N the non-embedding
parameters:

    target batch  round(2048 x 160 x (N / 108e6)^(2/3)) tokens      (Porian et al. 2024)
    peak LR       0.0047 x (N / 108e6)^(-1/3) / 2 x lr_multiplier   (Porian et al. 2024, halved
                                                                     as OLMo)
    AdamW         beta2 = 0.95 if the batch is >= 524,288 tokens else 0.99; weight decay 0.1,
                  none on embeddings
    warmup        N tokens
    duration      chinchilla_multiple x tokens_per_param x N tokens, to the nearest whole batch
    schedule      WSD-S periods ending at 0.5x, 1x, 2x, ... chinchilla_multiple Chinchilla
                  durations, each ending with a linear decay (to 0) over decay_fraction of the
                  period
    checkpoints   two per period, before and after its decay

A checkpoint after a decay is a finished run of that length: one ladder run of a size gives several
points (tokens, loss) for the scaling-law fit. `plan_batch` is OLMo-core's
`ModelLadder._configure_batch_size_and_num_devices`, step for step.

Three settings replace a rule where a laptop cannot follow it (config/ladder_shakespeare.py uses
them; docs/ladder.md gives the measurements behind each):
- `ladder.batch_tokens`: one fixed batch for every size. With Porian's batch the small sizes take
  more steps per token than the large ones, and at a few hundred steps the loss is set by the number
  of steps.
- `ladder.duration_tokens`: the duration unit in tokens, the same for every size, instead of a
  Chinchilla duration: 20 tokens per parameter of a 400K-parameter model is 8M tokens, an hour of a
  CPU.
- `ladder.warmup_tokens`: a short warmup. N tokens would be most of a CPU run (too long a warmup for
  small models: Porian et al. 2024).
The LR keeps Porian's N^(-1/3) shape; its constant (`ladder.lr_multiplier`) comes from a sweep.
"""

import math
import warnings
from dataclasses import dataclass

from config import ConfigError

REFERENCE_PARAMS = 108e6  # the N at which Porian et al.'s batch and LR rules are anchored
LARGE_BATCH_TOKENS = 524_288  # from this batch up, beta2 = 0.95 (else 0.99), as OLMo-core


def target_batch_tokens(n):
    return round(2048 * 160 * (n / REFERENCE_PARAMS) ** (2 / 3))


def peak_lr(n, lr_multiplier=1.0):
    return 0.0047 * (n / REFERENCE_PARAMS) ** (-1 / 3) / 2 * lr_multiplier


def beta2(batch_tokens):
    return 0.95 if batch_tokens >= LARGE_BATCH_TOKENS else 0.99


def period_multiples(chinchilla_multiple):
    """[0.5, 1, 2, ..., chinchilla_multiple]: where the WSD-S periods end, in Chinchilla durations.
    """
    if chinchilla_multiple < 0.5 or not math.log2(chinchilla_multiple).is_integer():
        raise ConfigError(f"ladder.chinchilla_multiple={chinchilla_multiple} is not a power of two "
                          "of 0.5 or more; use 0.5, 1, 2, 4, ...")
    multiples = [0.5]
    while multiples[-1] < chinchilla_multiple:
        multiples.append(multiples[-1] * 2)
    return multiples


@dataclass(frozen=True)
class BatchPlan:
    batch_tokens: int  # the global batch actually used
    micro_batch_tokens: int  # per device per micro-step
    devices: int  # devices the run uses
    dp_world_size: int  # data-parallel ranks
    grad_accum_steps: int  # micro-steps per optimizer step


def plan_batch(target, micro_batch_tokens, sequence_length, min_world_size, min_dp_world_size,
               max_devices,
               size="?"):
    """OLMo-core's _configure_batch_size_and_num_devices. One difference: the micro-batch, capped at
    the target, is rounded down to whole sequences (OLMo asserts it already is)."""
    micro = min(micro_batch_tokens, target)
    micro = max(sequence_length, micro // sequence_length * sequence_length)
    min_dp_world_size = min_dp_world_size or min_world_size
    if min_world_size % min_dp_world_size:
        raise ConfigError(f"size {size}: the minimum world size {min_world_size} is not divisible "
                          f"by the minimum data-parallel size {min_dp_world_size}.")
    if max_devices < min_world_size:
        raise ConfigError(f"size {size} needs at least {min_world_size} devices but "
                          f"ladder.max_devices is {max_devices}; raise it or drop the size.")
    # The batch becomes a multiple of micro-batch x minimal data-parallel size ...
    factor = micro * min_dp_world_size
    batch = max(1, round(target / factor)) * factor
    # ... then devices grow up to max_devices, by at most the accumulation steps there would be ...
    expansion = min(max_devices // min_world_size, batch // factor)
    devices, dp_world_size = min_world_size * expansion, min_dp_world_size * expansion
    # ... and the batch is re-rounded to a multiple of one micro-step over all data-parallel ranks.
    per_micro_step = micro * dp_world_size
    batch = max(1, round(batch / per_micro_step)) * per_micro_step
    if abs(batch - target) / target > 0.1:
        closer = "; a smaller micro-batch would get closer" if micro // sequence_length > 1 else ""
        warnings.warn(f"size {size}: the batch of {batch:,} tokens is "
                      f"{100 * abs(batch - target) / target:.1f}% off the target of {target:,}"
                      f"{closer}.")
    return BatchPlan(batch, micro, devices, dp_world_size, batch // per_micro_step)


@dataclass(frozen=True)
class RunPlan:
    lr: float
    beta2: float
    warmup_steps: int
    duration_tokens: int
    max_steps: int
    periods: list  # WSD-S period lengths, steps
    checkpoints: list  # [(name, step)] in step order, the initialization (step 0) first


def plan_run(n, batch_tokens, *, chinchilla_multiple, tokens_per_param, lr_multiplier,
             decay_fraction,
             duration_tokens=0, warmup_tokens=0):
    """Everything but the batch: LR, beta2, warmup, duration and the WSD-S periods with their
    checkpoints. The duration unit is `duration_tokens` (checkpoint names `0.5xD-...`), or one
    Chinchilla duration, tokens_per_param x N (`0.5xC-...`); the warmup is `warmup_tokens`, or N
    tokens."""
    unit, unit_name = (duration_tokens, "D") if duration_tokens else (tokens_per_param * n, "C")
    duration_tokens = round(chinchilla_multiple * unit / batch_tokens) * batch_tokens
    if duration_tokens == 0:
        raise ConfigError(f"the run of {n:,} parameters is shorter than one batch of "
                          f"{batch_tokens:,} tokens; raise ladder.tokens_per_param, "
                          "ladder.duration_tokens or ladder.chinchilla_multiple.")
    ends = [round(m * unit / batch_tokens) for m in period_multiples(chinchilla_multiple)]
    checkpoints, periods, start = [("initialization", 0)], [], 0
    for multiple, end in zip(period_multiples(chinchilla_multiple), ends):
        length = end - start
        if length < 1:
            raise ConfigError(f"the WSD-S period ending at {multiple}x{unit_name} is shorter than "
                              "a step; raise ladder.tokens_per_param or ladder.duration_tokens, or "
                              "drop the smallest sizes.")
        decay = round(decay_fraction * length)  # as schedule.build_schedule rounds it
        checkpoints += [
            (f"{multiple:g}x{unit_name}-pre-decay", end - decay),
            (f"{multiple:g}x{unit_name}-post-decay", end),
        ]
        periods.append(length)
        start = end
    # a period too short to decay gives one step twice
    checkpoints = list(dict.fromkeys(checkpoints))
    warmup_steps = (warmup_tokens or n) // batch_tokens
    if warmup_steps + round(decay_fraction * periods[0]) > periods[0]:
        raise ConfigError(f"the warmup of {warmup_tokens or n:,} tokens and the first decay do not "
                          f"fit in the first period ({periods[0]} steps); shorten the warmup or "
                          "lengthen the duration.")
    return RunPlan(lr=peak_lr(n, lr_multiplier), beta2=beta2(batch_tokens),
                   warmup_steps=warmup_steps,
                   duration_tokens=duration_tokens, max_steps=duration_tokens // batch_tokens,
                   periods=periods,
                   checkpoints=checkpoints)
