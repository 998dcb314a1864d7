"""Exercise 2: gradient accumulation, or why 2 ranks equal 1 rank with 2 micro-steps.

Goal: accumulate the gradient of a batch too big for one forward pass over several micro-batches, so
that the optimizer step is the same as if the whole batch had gone through at once. train.py does it
on every step: a step of train.total_batch_size tokens is grad_accum_steps micro-steps on each rank.
With DDP, 2 ranks each run 1 micro-step and average their gradients (the all-reduce); 1 rank with 2
micro-steps must give the same average, and this is what makes it so.
In the project: train.py, `train_step` (its loop over micro-steps, and the comment on dividing the loss).
Check: python exercises/check.py 2
(your gradients against one forward pass over the whole batch, and against `train_step`'s, on a tiny
GPT with fresh random tokens and 2 to 4 micro-steps)
"""

import torch


def accumulate_gradients(model, micro_batches):
    """Forward and backward over `micro_batches`, a list of (x, y) pairs of the same shape, leaving in
    every parameter's `.grad` the gradient of the mean loss over all of them, exactly what one
    forward and backward pass over their union would leave. Return that mean loss, as a tensor
    without gradient (detached).
    """
    total = torch.zeros(())
    for x, y in micro_batches:
        loss = model(x, y)
        (loss / len(micro_batches)).backward()
        total += loss.detach() / len(micro_batches)
    return total
