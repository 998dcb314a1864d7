"""Exercise 5: a new metric through record_metric.

Goal: log the update-to-weight ratio of every step, ||W_after - W_before|| / ||W_before|| over all
the parameters: how far one optimizer step moves the weights, relative to their size (around 1e-3 is
a common rule of thumb; much larger means a learning rate too high). It must reach metrics.jsonl like
train/loss does: recorded on the device, without a host-device sync, with a reduction that stays
right on any number of ranks.
In the project: metrics.py, `MetricRecorder.record_metric` (read its docstring for `reduce`) and
`record_all`; train.py's loop calls `recorder.record_all(step_metrics)` after every `train_step`.
Check: python exercises/check.py 5
(a short real training run, in your answer's process, that calls your function after every step; then
its metrics.jsonl must hold your metric at every step with the value the check computes from the same run)
"""

import torch


def record_update_ratio(recorder, model, weights_before):
    """Record the step's update-to-weight ratio as the metric "optim/update_ratio" with
    `recorder.record_metric`. `weights_before` is {name: tensor} of `model.named_parameters()` copied
    before the optimizer step; `model` holds the weights after it.
    """
    changes, sizes = [], []
    for name, weight in model.named_parameters():
        before = weights_before[name]
        changes.append((weight.detach() - before).norm())
        sizes.append(before.norm())
    ratio = torch.linalg.vector_norm(torch.stack(changes)) / torch.linalg.vector_norm(torch.stack(sizes))
    recorder.record_metric("optim/update_ratio", ratio, reduce="mean")
