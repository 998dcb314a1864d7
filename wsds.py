"""WSD-S, Warmup-Stable-Decay-Simplified (Wen et al. 2024; OLMo-core's WSDS): optim.schedule=wsds. Periods P1..Pk
each hold their peak (lr x its multiplier) and decay over their last D_i steps to min_lr; the next period jumps back
to its peak. The checkpoint at each decay's bottom is a finished run of that length, which is what a model ladder
measures (`period_ends`, which the dry run prints). A module of its own because no other schedule uses it:
optimizer.py's Schedule and build_schedule hand their wsds case here, so a run with another schedule never reads this.
"""

import itertools

from config import ConfigError


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
