"""Exercise 4: MFU from the FLOP count.

Goal: count the training FLOPs per token of a GPT, then turn a measured speed into MFU (model FLOPs
utilisation): the share of the accelerator's peak that the model's own arithmetic uses. The loop logs
it every step as throughput/mfu; README.md's 48.4% for GPT-2 on an H100 is this number.
In the project: model.py, `GPT.flops_per_token`; metrics.py, `mfu` (throughput/mfu, which `StepClock.lap` logs).
Check: python exercises/check.py 4
(your count against the project's on random model shapes, GPT-2's included, and your MFU against
metrics.mfu's on random speeds)
"""


def flops_per_token(model):
    """Training FLOPs per token of `model` (a model.GPT), as PaLM's appendix B counts them.
    """
    c = model.config
    n = model.num_params(non_embedding=True) + c.n_embd * c.vocab_size
    return 6 * n + 12 * c.n_layer * c.n_embd * c.block_size


def mfu(flops_per_token, tokens_per_sec, world_size, peak_flops):
    """The MFU of a run that trains `tokens_per_sec` tokens per second (all ranks together) on
    `world_size` devices of `peak_flops` FLOP/s each: a number between 0 and 1.
    """
    return flops_per_token * tokens_per_sec / world_size / peak_flops
