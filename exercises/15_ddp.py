"""Exercise 15: data parallelism in practice, what DDP does after backward.

Goal: two processes each take half of a batch, compute their loss and its gradients, and then must
take the same optimizer step as one process that saw the whole batch. DistributedDataParallel does it by
averaging the gradients over the ranks (an all-reduce) during backward. Write that averaging by hand;
the check runs it for real under `torchrun --nproc-per-node=2` on gloo, the CPU backend.
In the project: train.py wraps the model in DDP (`wrap_model`) and all-reduces only on the last
micro-step (`train_step`, model.no_sync()).
Check: python exercises/check.py 15
(torchrun runs 2 processes with your function; the gradient every rank holds after it must equal the gradient
one process computes over the whole batch, to float tolerance)
"""

import torch.distributed as dist


def average_gradients(model, world_size):
    """After backward on every rank: make each parameter's .grad the mean of its gradients over the ranks."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size
