"""Exercise 22: choosing a learning rate with a range test.

Goal: before a long run, a short one can say which learning rates train: the LR range test (Smith 2017, "Cyclical
Learning Rates for Training Neural Networks"; fastai's `lr_find`) raises the LR geometrically at every step,
from far too small to far too large, and records the loss. Too small, the loss barely moves; in a band it
falls fast; too large, it jumps about and blows up. Read a range test the way fastai suggests: smooth the losses
(an exponential moving average, weight 0.9 on the past, corrected for its start at zero as Adam corrects its
moments: the average after i steps divided by 1 - 0.9^i), stop reading once the smoothed loss exceeds 4 times
the lowest smoothed loss so far (it diverged), and suggest a tenth of the LR at which the smoothed loss was
lowest: the minimum sits at the edge of stability, and an LR ten times smaller trains fast and safely.
In the project: train.py logs each step's `optim/lr` and `train/loss` to metrics.jsonl; optimizer.py's
`Schedule.lr_at` sets the LR of each step (the check replaces it with a geometric sweep); the peaks the
quick start trains with are config/shakespeare.py's `optim.lr` (AdamW's part) and `optim.muon_lr` (Muon's).
Check: python exercises/check.py 22
(the check runs a real range test with train.py on a small GPT, 60 steps from 1e-5 to 3, and gives you its LRs
and losses; your suggestion must be the one the rule above gives)
"""


def suggest_lr(lrs, losses):
    """The learning rate a range test suggests: `lrs` and `losses` are the LR and the train loss of each of its
    steps, in order (the LR rising)."""
    average, best, best_lr = 0.0, float("inf"), lrs[0]
    for i, (lr, loss) in enumerate(zip(lrs, losses), 1):
        average = 0.9 * average + 0.1 * loss
        smoothed = average / (1 - 0.9 ** i)
        if smoothed > 4 * best:
            break
        if smoothed < best:
            best, best_lr = smoothed, lr
    return best_lr / 10
