"""Exercise 12: the AdamW update, one parameter tensor at a time.

Goal: write what `optimizer.step()` does to one weight under AdamW: running averages of the gradient
and of its square, their bias correction, the step, and weight decay that is decoupled from the
gradient (Loshchilov & Hutter 2019): the weights shrink by lr x weight_decay, whatever the moments say.
In the project: optimizer.py builds torch.optim.AdamW (betas 0.9, 0.95; weight decay on matrices only).
Check: python exercises/check.py 12
(three steps of your update against torch.optim.AdamW on random tensors and settings: the weights, and the
moment buffers, which hold what the gradients did)
"""

import math


def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step, in place, on `param` and its moment buffers `exp_avg` and `exp_avg_sq` (zeros before
    the first step; the caller keeps them for the next step); `grad` is only read; `step` counts from 1.
    Returns nothing."""
    param.mul_(1 - lr * weight_decay)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1 ** step))
