"""Learning-rate schedules: the LR of optimizer step n (1-based: the `optim/lr` logged at step n).

    cosine    warmup, then cosine decay to optim.min_lr at the run's last step (GPT-3; the default)
    linear    warmup, then a straight line down to min_lr at the last step
    constant  warmup, then optim.lr
    wsd       warmup, stable at lr, then a decay over the last D steps to min_lr (Hägele et al. 2024)
    wsds      Warmup-Stable-Decay-Simplified (Wen et al. 2024; OLMo-core's WSDS): periods P1..Pk, each
              holding its peak (lr x its multiplier) and decaying over its last D_i steps to min_lr; the
              next period jumps back to its peak. A checkpoint at the bottom of each decay is a finished
              run of that length, which is what a model ladder measures.

Warmup is `optim.warmup_steps`, or `optim.warmup_fraction` of the run (of P1 for wsds). The decay is
`optim.decay_steps`, or `optim.decay_fraction` of the run (of each period for wsds), shaped by
`optim.decay_shape`: s(x) = x (linear), (1 - cos(pi x)) / 2 (cosine), 1 - sqrt(1 - x) (1-sqrt), where x
falls from 1 to 0 over the decay.
"""

import math
from dataclasses import dataclass

from config import ConfigError


def decay_shape(name, x):
    """1 at the start of a decay (x = 1), 0 at its end (x = 0)."""
    if name == "linear":
        return x
    if name == "cosine":
        return (1 - math.cos(math.pi * x)) / 2
    return 1 - math.sqrt(1 - x)  # 1-sqrt


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
        T, W, peak, floor = self.total_steps, self.warmup_steps, self.lr, self.min_lr
        if self.kind == "wsds":
            return self._wsds(n)
        if n <= W:
            return peak * n / W
        if self.kind == "constant":
            return peak
        if self.kind == "cosine":  # written as it always was: progress from the end of warmup
            progress = min(1.0, (n - 1 - W) / max(1, T - W))
            return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (peak - floor)
        if self.kind == "linear":
            return floor + (peak - floor) * max(0, T - n) / max(1, T - W)
        D = self.decay_steps[0]  # wsd
        if n >= T - D:
            return floor + (peak - floor) * decay_shape(self.shape, max(0, T - n) / D) if D else floor
        return peak

    def _wsds(self, n):
        start = 0
        for i, (length, D) in enumerate(zip(self.periods, self.decay_steps)):
            if n <= start + length:
                m, peak = n - start, self.lr * self.multipliers[i]
                if i == 0 and m <= self.warmup_steps:
                    return peak * m / self.warmup_steps
                if m >= length - D:
                    return (
                        self.min_lr + (peak - self.min_lr) * decay_shape(self.shape, (length - m) / D)
                        if D
                        else self.min_lr
                    )
                return peak
            start += length
        return self.min_lr  # after the last period

    def period_ends(self):
        """wsds: the step at the bottom of each period's decay (a finished run of that length)."""
        ends, total = [], 0
        for length in self.periods:
            total += length
            ends.append(total)
        return ends


def build_schedule(optim, total_steps):
    """The run's Schedule from the `optim` section; a combination that cannot work is one sentence."""
    o = optim
    if o.schedule == "wsds":
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
        multipliers = tuple(o.period_lr_multipliers) or (1.0,) * len(o.periods)
        return Schedule("wsds", o.lr, o.min_lr, total_steps, warmup, decays, tuple(o.periods), multipliers,
                        o.decay_shape)
    warmup = o.warmup_steps or round(o.warmup_fraction * total_steps)
    decay = o.decay_steps or round(o.decay_fraction * total_steps)
    if o.schedule == "wsd" and warmup + decay > total_steps:
        raise ConfigError(f"optim.schedule=wsd: warmup ({warmup} steps) plus decay ({decay} steps) is longer than "
                          f"the run ({total_steps} steps); shorten one of them.")
    return Schedule(o.schedule, o.lr, o.min_lr, total_steps, warmup, (decay,), shape=o.decay_shape)


def plot_schedule(schedule, path, marks=()):
    """A PNG of the LR over the run's steps, with vertical lines at `marks` [(step, label), ...]."""
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    steps = range(1, schedule.total_steps + 1)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(list(steps), [schedule.lr_at(n) for n in steps])
    for step, label in marks:
        ax.axvline(step, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate(label, (step, schedule.lr), rotation=90, fontsize=7, va="top", ha="right")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title(f"{schedule.kind} schedule, {schedule.total_steps:,} steps")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
