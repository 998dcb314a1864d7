"""Exercise 1: the learning-rate schedule.

Goal: write the learning rate of optimizer step n for the cosine and the WSD (warmup-stable-decay)
schedules. The loop sets it before every step: `lr = run.schedule.lr_at(n)` in train.py's `train`.
In the project: optimizer.py, `Schedule.lr_at`; the comment above it states each schedule in words.
Check: python exercises/check.py 1
(your `lr_at` against the project's on random schedules, at their boundaries and at random steps)
"""

import math


def lr_at(schedule, n):
    """The learning rate of optimizer step n (1-based) under `schedule`, an optimizer.Schedule whose
    `kind` is "cosine" or "wsd". Its fields: `lr` (the peak), `min_lr` (the floor), `total_steps` (T),
    `warmup_steps` (W), `decay_steps` (wsd: a tuple (D,)) and `shape` (wsd's decay shape: "linear",
    "cosine" or "1-sqrt").
    """
    T, W, peak, floor = schedule.total_steps, schedule.warmup_steps, schedule.lr, schedule.min_lr
    if n <= W:
        return peak * n / W
    if schedule.kind == "cosine":
        progress = min(1.0, (n - 1 - W) / max(1, T - W))
        return floor + (peak - floor) * (1 + math.cos(math.pi * progress)) / 2
    D = schedule.decay_steps[0]
    if n < T - D:
        return peak
    if D == 0:  # no decay steps: the last step drops straight to the floor
        return floor
    x = max(0, T - n) / D
    if schedule.shape == "linear":
        s = x
    elif schedule.shape == "cosine":
        s = (1 - math.cos(math.pi * x)) / 2
    else:  # 1-sqrt
        s = 1 - math.sqrt(1 - x)
    return floor + (peak - floor) * s
