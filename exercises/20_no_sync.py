"""Exercise 20: DDP as the trainer does it: gradient accumulation, with one all-reduce per step.

Goal: under DistributedDataParallel each rank runs its micro-steps, and DDP all-reduces (averages over the
ranks) the gradients during backward, bucket by bucket, as soon as a bucket's gradients are ready, so that
communication overlaps the rest of backward. With accumulation, doing so on every micro-step would send the
same amount of data once per micro-step for nothing: only the sum over the micro-steps matters. Inside
`model.no_sync()` DDP only accumulates; the backward of the last micro-step, outside it, all-reduces what
was accumulated. Write one optimizer step's forward and backward that way.
In the project: train.py, `train_step` (`model.no_sync()` on every micro-step but the last) and `wrap_model`
(the DDP wrapper); build-nanogpt toggles `require_backward_grad_sync` for the same effect.
Check: python exercises/check.py 20
(torchrun runs 2 gloo processes with your function for two steps of 3 micro-steps each; every rank's gradient
must equal one process's over all 6 micro-batches, and DDP's all-reduces, counted by the grader through a
communication hook, must be one per bucket per step, on the last micro-step)
"""

from contextlib import nullcontext

import torch


def accumulate_with_ddp(model, micro_batches):
    """One optimizer step's forward and backward on this rank: `model` is wrapped in DDP, `micro_batches` is this
    rank's list of (x, y). Leave in every parameter's .grad the gradient of the mean loss over all the ranks'
    micro-batches, with DDP all-reducing only once; return this rank's mean loss over its micro-batches, as a
    tensor without gradient."""
    total = torch.zeros(())
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with nullcontext() if last else model.no_sync():
            loss = model(x, y)
            (loss / len(micro_batches)).backward()
        total += loss.detach() / len(micro_batches)
    return total
