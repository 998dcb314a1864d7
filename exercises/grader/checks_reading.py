"""The checks of exercises 22 and 23: reading a real run's metrics. Here the check runs train.py on a small GPT,
with the learning rate of each step replaced (`Schedule.lr_at`, patched in this process only): a geometric sweep
for 22's range test, one surging step for 23's spike. The student's functions read its metrics.jsonl. 23 then
rewinds the run for real (`--checkpoint.resume_step`) to the checkpoint the student chose.
"""

import functools
import os
import shutil
import tempfile

from exercises.grader.checking import ExerciseFailed, TINY_RUN, is_close, patched, run_training, shown
from exercises.grader.feed_reading import lr_answers, spike_answers

# ----------------------------------------------------------------------------- 22. the LR range test

SWEEP = (60, 1e-5, 3.0)  # steps, first LR, last LR


@functools.lru_cache(maxsize=None)
def range_test(data_root):
    """train.py's losses under a geometric LR sweep: ([lr of each step], [loss of each step]); seeded, so the
    same for every answer graded here."""
    import optimizer

    steps, low, high = SWEEP

    def geometric(schedule, n):
        return low * (high / low) ** ((n - 1) / (steps - 1))

    with tempfile.TemporaryDirectory() as out, patched(optimizer.Schedule, "lr_at", geometric):
        rows = run_training(TINY_RUN + [f"--data.data_root={data_root}", f"--train.max_steps={steps}",
                                        "--eval.interval=0", "--train.no_checkpoints=true", "--data.batch_size=8",
                                        "--train.total_batch_size=256", f"--train.out_dir={out}"])
    return tuple(row["optim/lr"] for row in rows), tuple(row["train/loss"] for row in rows)


def smoothed(losses, corrected=True):
    """The exponential moving average (0.9 on the past) of the losses, corrected for its start at zero."""
    average, out = 0.0, []
    for i, loss in enumerate(losses, 1):
        average = 0.9 * average + 0.1 * loss
        out.append(average / (1 - 0.9 ** i) if corrected else average)
    return out


def lowest(lrs, losses, stop=True):
    """The LR of the lowest loss, read up to where the loss exceeds 4 times the lowest so far (with `stop`)."""
    best, best_lr = float("inf"), lrs[0]
    for lr, loss in zip(lrs, losses):
        if stop and loss > 4 * best:
            break
        if loss < best:
            best, best_lr = loss, lr
    return best_lr


def range_tests(lrs, losses, rng):
    """Range tests drawn from the real one: [(what it is, lrs, losses)]. The real run; its sweep moved (every LR
    times a factor) and cut (its first steps left out, so that its lowest loss is at another step: an answer that
    reads the real run's step by number fails), with noise on the losses; and one that diverges early, after which
    its losses (as a broken run's can) read low again, so that only a reader who stops at divergence takes the right
    LR."""
    tests = [("the real run", list(lrs), list(losses))]
    factor, noise, cut = 10 ** rng.uniform(-1, 1), rng.uniform(0.02, 0.1), rng.randint(4, 16)
    tests.append((f"the real run's losses with noise, its LRs moved and its first {cut} steps cut",
                  [lr * factor for lr in lrs[cut:]], [loss + rng.gauss(0, noise) for loss in losses[cut:]]))
    while True:
        at, low = rng.randint(12, 30), rng.uniform(0.2, 0.5)
        best = min(smoothed(losses[:at]))
        early = list(losses[:at]) + [best * rng.uniform(8, 12)] * rng.randint(3, 6)
        early += [best * low] * (len(lrs) - len(early))
        if lowest(lrs, smoothed(early), stop=False) != lowest(lrs, smoothed(early)):
            tests.append((f"one that diverges at step {at + 1}", list(lrs), early))
            return tests


def check_lr_range_test(answers, data_root=""):
    import random

    lrs, losses = range_test(str(data_root))
    tests = range_tests(lrs, losses, random.Random(random.getrandbits(64)))
    mine = answers.run(lr_answers, tests)
    if not isinstance(mine, list) or len(mine) != len(tests):
        raise ExerciseFailed("your suggest_lr did not return one learning rate per range test.")
    for number, ((what, lrs, losses), suggested) in enumerate(zip(tests, mine), 1):
        at_minimum = lowest(lrs, smoothed(losses))
        if is_close(suggested, at_minimum / 10, rel=1e-9):
            continue
        mistakes = [(at_minimum, "suggest a tenth of it: at its minimum the loss is already at the edge of "
                                 "stability, and a long run needs room"),
                    (lowest(lrs, losses) / 10, "smooth the losses first: one step's loss is noisy, and the lowest "
                                               "raw loss is often luck"),
                    (lowest(lrs, smoothed(losses, corrected=False)) / 10, "correct the average for its start at "
                                                                          "zero (divide by 1 - 0.9^i), or its first "
                                                                          "steps read too low"),
                    (lowest(lrs, smoothed(losses), stop=False) / 10, "stop reading once the smoothed loss exceeds 4 "
                                                                     "times its lowest: past that the run diverged")]
        advice = next((text for value, text in mistakes if is_close(suggested, value, rel=1e-9)),
                      "smooth, stop at divergence, take the LR of the lowest smoothed loss, and a tenth of it")
        # (the rule's value is not printed: a few retries would read it off instead of the rule)
        raise ExerciseFailed(f"on range test {number} of {len(tests)} ({what}) your suggestion, "
                             f"{shown(suggested)}, is not what the rule gives: {advice}.")
    at_minimum = lowest(tests[0][1], smoothed(tests[0][2]))
    start = smoothed(tests[0][2])[0]
    moving = next(lr for lr, loss in zip(tests[0][1], smoothed(tests[0][2])) if loss < start - 0.1)
    return (f"on {len(tests)} range tests (a real one from {SWEEP[1]:g} to {SWEEP[2]:g} over {SWEEP[0]} steps, "
            f"one moved, cut and noisy, one that diverges early) you suggest what the rule does: in the real one the "
            f"smoothed loss starts to fall near lr {moving:.2g}, is lowest at {at_minimum:.2g}, and you suggest "
            f"{at_minimum / 10:.2g} (the quick start's larger model trains AdamW's part at a peak of "
            f"{quick_start_lr():g}: config/shakespeare.py).")


def quick_start_lr():
    """The peak LR of AdamW's part in `python train.py`, read from its config (config/shakespeare.py)."""
    from config import parse_args
    return parse_args([]).optim.lr


# ----------------------------------------------------------------------------- 23. a loss spike

SURGE, SURGE_STEP, THRESHOLD = 300, 40, 1.0  # step 40's update at 300 times its LR; train.loss_spike_threshold


def spike_args(data_root, out):
    return TINY_RUN + [f"--data.data_root={data_root}", "--train.max_steps=60", "--eval.interval=0",
                       "--checkpoint.interval=5", "--checkpoint.keep_last=0", "--optim.lr=3e-3",
                       "--optim.warmup_steps=5", f"--train.loss_spike_threshold={THRESHOLD}", f"--train.out_dir={out}"]


@functools.lru_cache(maxsize=None)
def spiked_run(data_root):
    """The run whose update of SURGE_STEP has SURGE times its LR: (its folder, losses, steps flagged, checkpoint
    steps). Seeded, so the same for every answer graded here; a rewind works on a copy of the folder."""
    import optimizer

    original, folder = optimizer.Schedule.lr_at, tempfile.TemporaryDirectory()

    def surging(schedule, n):
        return original(schedule, n) * (SURGE if n == SURGE_STEP else 1)

    with patched(optimizer.Schedule, "lr_at", surging):
        rows = run_training(spike_args(data_root, folder.name))
    checkpoints = sorted(int(name[4:]) for name in os.listdir(folder.name)
                         if name.startswith("step") and name[4:].isdigit())
    return folder, [row["train/loss"] for row in rows], [row["step"] for row in rows if "train/loss_spike" in row], \
        checkpoints


def rewound(data_root, step):
    """The losses of the spiked run rewound to its step-`step` checkpoint, the surge gone: {step: loss}."""
    with tempfile.TemporaryDirectory() as copy:
        out = shutil.copytree(spiked_run(data_root)[0].name, os.path.join(copy, "run"), symlinks=True)
        rows = run_training(spike_args(data_root, out) + [f"--checkpoint.resume_step={step}"])
    return {row["step"]: row["train/loss"] for row in rows}


def spike_cases(losses, rng):
    """Loss curves drawn from the real run's before its surge: [(losses, threshold, window)], each with a spike
    at a random step after which the loss comes back, a jump too early to judge (fewer than 10 losses before it),
    where the window allows one a jump that only the window's mean makes a spike (the loss falls as the run trains,
    so the mean of every loss before it is higher), and a NaN somewhere (it joins no mean)."""
    calm, cases = list(losses[:SURGE_STEP]), []
    for _ in range(2):
        curve = calm + [calm[-1] + rng.gauss(0, 0.02) for _ in range(rng.randint(5, 20))]
        at, height = rng.randint(15, len(curve) - 3), rng.uniform(1.5, 3.0)
        threshold, window = round(rng.uniform(0.5, 1.2), 2), rng.choice([20, 30, 50])
        curve[at - 1] += height + threshold  # a spike at step `at`
        curve[at] += height / 2 + threshold  # and, often, the step after it
        curve[rng.randint(2, 9) - 1] += height + threshold  # not a spike: too few losses before it to judge
        later = [s for s in range(window + 12, len(curve) + 1) if abs(s - at) > 2]
        for step in rng.sample(later, len(later)):
            before = [loss for loss in curve[:step - 1] if loss == loss]
            recent, whole = sum(before[-window:]) / len(before[-window:]), sum(before) / len(before)
            if whole > recent + 0.1:  # above the window's mean plus the threshold, below the whole history's
                curve[step - 1] = recent + threshold + 0.05
                break
        curve[rng.randint(1, len(curve) - 1)] = float("nan")
        cases.append((curve, threshold, window))
    return cases


def flagged_by_the_trainer(losses, threshold, window):
    """The steps metrics.py's LossSpikeDetector flags in `losses`: the trainer's own rule."""
    from metrics import LossSpikeDetector

    detector = LossSpikeDetector(threshold, window)
    rows = [(step, {"train/loss": loss}) for step, loss in enumerate(losses, 1)]
    detector.flag(rows)
    return [step for step, values in rows if "train/loss_spike" in values]


def rewind_cases(first, checkpoints, rng):
    """(spike step, checkpoint steps) of the real run, then of runs drawn with other intervals and spikes."""
    cases = [(first, list(checkpoints))]
    for _ in range(3):
        interval = rng.randint(2, 9)
        saved = list(range(interval, rng.randint(60, 120), interval))
        cases.append((rng.randint(saved[1] + 2, saved[-1]), saved))
    return cases


def compare_spikes(cases, found):
    for number, ((losses, threshold, window), mine) in enumerate(zip(cases, found), 1):
        flagged = flagged_by_the_trainer(losses, threshold, window)
        if isinstance(mine, list) and sorted(mine) == flagged:
            continue
        step = min(set(flagged) ^ (set(mine) if isinstance(mine, list) else set()))
        previous = [loss for loss in losses[:step - 1] if loss == loss][-window:]
        flags = step in flagged
        what = "the real run" if number == 1 else f"curve {number} of {len(cases)}"
        mean = sum(previous) / len(previous)
        raise ExerciseFailed(f"in {what} (threshold {threshold:g}, window {window}) the trainer "
                             f"{'flags' if flags else 'does not flag'} step {step} (loss {losses[step - 1]:.4g}, the "
                             f"mean of the {len(previous)} finite losses before it {mean:.4g}) and your find_spikes "
                             f"{'does not' if flags else 'does'}: a spike is a loss above the mean "
                             f"of the previous `window` finite losses (not counting itself) plus the threshold, once "
                             f"at least 10 are there; each step is judged on its own.")


def compare_rewinds(cases, chosen):
    for number, ((first, saved), choice) in enumerate(zip(cases, chosen), 1):
        right = max(step for step in saved if step <= first - 2)
        what = "the real run" if number == 1 else f"run {number} of {len(cases)}"
        if choice not in saved:
            raise ExerciseFailed(f"in {what} you rewind to {shown(choice)}, which is no checkpoint of the run "
                                 f"(it saved at steps {saved[0]}, {saved[1]}, ..., {saved[-1]}).")
        if choice > right:
            return number, choice
        if choice < right:
            raise ExerciseFailed(f"in {what} (spike at step {first}) you rewind to step {choice}, but a later "
                                 f"checkpoint is still before the update that made the spike: the latest such "
                                 f"checkpoint throws away the fewest steps.")
    return None


def check_loss_spike(answers, data_root=""):
    import random

    _, losses, flagged, checkpoints = spiked_run(str(data_root))
    assert flagged and flagged[0] == SURGE_STEP + 1, f"the surge must make a spike at step {SURGE_STEP + 1}"
    first, rng = flagged[0], random.Random(random.getrandbits(64))
    spikes = [(losses, THRESHOLD, 50)] + spike_cases(losses, rng)
    rewinds = rewind_cases(first, checkpoints, rng)
    mine = answers.run(spike_answers, {"spikes": spikes, "rewind": rewinds})
    compare_spikes(spikes, mine["spikes"])
    too_late = compare_rewinds(rewinds, mine["rewind"])
    if too_late:
        number, choice = too_late
        spike = rewinds[number - 1][0]
        rewound_real = (f"rewound to step {choice} with the surge gone, the run still logs "
                        f"{rewound(str(data_root), choice)[first]:.4g} at step {first}: " if number == 1 else
                        f"in run {number} of {len(rewinds)} (spike at step {spike}) you rewind to step {choice}: ")
        raise ExerciseFailed(f"{rewound_real}the step-{choice} checkpoint holds step {choice}'s update, which may have "
                             f"made the spike (the loss logged at step n is measured with the weights step n - 1 "
                             f"left), so go back to the latest checkpoint at or before step n - 2.")
    choice = mine["rewind"][0]
    after = rewound(str(data_root), choice)
    return (f"your spikes are the trainer's on the real run ({len(flagged)} steps flagged from step {first}, loss "
            f"{losses[first - 1]:.4g} after {losses[first - 2]:.4g}) and on {len(spikes) - 1} curves drawn from it, "
            f"and your rewinds are right in {len(rewinds)} runs; rewound to your step-{choice} checkpoint without the "
            f"surge, the real run logs {after[first]:.4g} at step {first}, no spike.")
