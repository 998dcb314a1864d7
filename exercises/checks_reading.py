"""The checks of exercises 22 and 23: reading a real run's metrics. Here the check runs train.py on a small GPT,
with the learning rate of each step replaced (`Schedule.lr_at`, patched in this process only): a geometric sweep
for 22's range test, one surging step for 23's spike. The student's functions read its metrics.jsonl. 23 then
rewinds the run for real (`--checkpoint.resume_step`) to the checkpoint the student chose.
"""

import functools
import os
import shutil
import tempfile

from exercises.checking import ExerciseFailed, TINY_RUN, is_close, patched, run_training, shown

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


def lr_answers(answers, inputs):
    return answers.suggest_lr(*inputs)


def check_lr_range_test(answers, data_root=""):
    lrs, losses = range_test(str(data_root))
    mine = answers.run(lr_answers, (lrs, losses))
    at_minimum = lowest(lrs, smoothed(losses))
    want = at_minimum / 10
    if not is_close(mine, want, rel=1e-9):
        mistakes = [(at_minimum, "suggest a tenth of it: at its minimum the loss is already at the edge of "
                                 "stability, and a long run needs room"),
                    (lowest(lrs, losses) / 10, "smooth the losses first: one step's loss is noisy, and the lowest "
                                               "raw loss is often luck"),
                    (lowest(lrs, smoothed(losses, corrected=False)) / 10, "correct the average for its start at "
                                                                          "zero (divide by 1 - 0.9^i), or its first "
                                                                          "steps read too low"),
                    (lowest(lrs, smoothed(losses), stop=False) / 10, "stop reading once the smoothed loss exceeds 4 "
                                                                     "times its lowest: past that the run diverged")]
        advice = next((text for value, text in mistakes if is_close(mine, value, rel=1e-9)),
                      "smooth, stop at divergence, take the LR of the lowest smoothed loss, and a tenth of it")
        got, expected = shown(mine, want)
        raise ExerciseFailed(f"you suggest {got} where the range test's smoothed loss is lowest at lr "
                             f"{at_minimum:.3g}, which suggests {expected}: {advice}.")
    start = smoothed(losses)[0]
    moving = next(lr for lr, loss in zip(lrs, smoothed(losses)) if loss < start - 0.1)
    return (f"a real range test from {SWEEP[1]:g} to {SWEEP[2]:g} over {SWEEP[0]} steps: the smoothed loss starts "
            f"to fall near lr {moving:.2g}, is lowest at {at_minimum:.2g}, and you suggest {want:.2g}, as the rule "
            f"does (the quick start's larger model trains AdamW's part at a peak of {quick_start_lr():g}: "
            f"config/shakespeare.py).")


def quick_start_lr():
    """The peak LR of AdamW's part in `python train.py`, read from its config (config/shakespeare.py)."""
    from config import parse_args
    return parse_args([]).optim.lr


# ----------------------------------------------------------------------------- 23. a loss spike

SURGE, SURGE_STEP, THRESHOLD = 300, 40, 1.0  # step 40's update at 300 times its LR; train.loss_spike_threshold


def spike_args(data_root, out):
    return TINY_RUN + [f"--data.data_root={data_root}", "--train.max_steps=60", "--eval.interval=0",
                       "--checkpoint.interval=2", "--checkpoint.keep_last=0", "--optim.lr=3e-3",
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


def spike_answers(answers, inputs):
    return {"spikes": answers.find_spikes(inputs["losses"], THRESHOLD, 50),
            "rewind": answers.rewind_step(inputs["first"], inputs["checkpoints"])}


def check_loss_spike(answers, data_root=""):
    _, losses, flagged, checkpoints = spiked_run(str(data_root))
    assert flagged and flagged[0] == SURGE_STEP + 1, f"the surge must make a spike at step {SURGE_STEP + 1}"
    first = flagged[0]
    mine = answers.run(spike_answers, {"losses": losses, "first": first, "checkpoints": checkpoints})
    spikes = mine["spikes"]
    if not isinstance(spikes, list) or sorted(spikes) != flagged:
        found = set(spikes) if isinstance(spikes, list) else set()
        step = min(set(flagged) ^ found)
        window = losses[max(0, step - 51):step - 1]
        flags = step in flagged
        raise ExerciseFailed(f"the trainer {'flags' if flags else 'does not flag'} step {step} (loss "
                             f"{losses[step - 1]:.4g}, the mean of the {len(window)} losses before it "
                             f"{sum(window) / len(window):.4g}, threshold {THRESHOLD:g}), and your find_spikes "
                             f"{'does not' if flags else 'does'}: a spike is a loss above the mean of the previous "
                             f"`window` losses (not counting itself) plus the threshold, once at least 10 are there.")
    right = max(step for step in checkpoints if step <= first - 2)
    choice = mine["rewind"]
    if choice not in checkpoints:
        raise ExerciseFailed(f"you rewind to {shown(choice, 0)[0]}, which is no checkpoint of the run (it saved at "
                             f"steps {checkpoints[0]}, {checkpoints[1]}, ..., {checkpoints[-1]}).")
    if choice > right:
        after = rewound(str(data_root), choice)
        raise ExerciseFailed(f"rewound to step {choice} with the surge gone, the run still logs {after[first]:.4g} at "
                             f"step {first}: the step-{choice} checkpoint holds step {choice}'s update, which made the "
                             f"spike (the loss logged at step n is measured with the weights step n - 1 left), so go "
                             f"back to the latest checkpoint at or before step n - 2.")
    if choice < right:
        raise ExerciseFailed(f"you rewind to step {choice}, but the checkpoint of step {right} is later and still "
                             f"before the update that made the spike at step {first}: the latest such checkpoint "
                             f"throws away the fewest steps.")
    after = rewound(str(data_root), choice)
    return (f"your spikes are the trainer's ({len(flagged)} steps flagged from step {first}, loss "
            f"{losses[first - 1]:.4g} after {losses[first - 2]:.4g}); rewound to your step-{choice} checkpoint "
            f"without the surge, the run logs {after[first]:.4g} at step {first}, no spike.")
