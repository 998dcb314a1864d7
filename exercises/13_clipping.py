"""Exercise 13: gradient clipping by the global norm.

Goal: a batch that happens to give a huge gradient should not throw the weights far: before the
optimizer step, when the norm of all the gradients together is above `optim.grad_clip`, every gradient
is scaled down by the same factor, so the update keeps its direction and its size is bounded.
In the project: train.py's `train_step` calls torch.nn.utils.clip_grad_norm_ and logs the norm it
returns (before clipping) as train/grad_norm.
Check: python exercises/check.py 13
(your clipping against clip_grad_norm_ on random gradients, above and below the limit)
"""

import torch


def clip_gradients(parameters, max_norm):
    """Scale the gradients of `parameters` (a list; a parameter without a gradient is skipped) in place so
    that their global norm is at most `max_norm`; return that global norm before clipping, as a tensor."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(scale)
    return total
