"""Exercise 17: mixed precision: what bf16 autocast runs in bfloat16, and why the loss is upcast.

Goal: on GPUs the trainer runs the forward pass under torch.autocast(dtype=torch.bfloat16): the matrix
multiplies, most of the work, run in bfloat16 (twice as fast, half the memory traffic), while the weights,
their gradients and the optimizer state stay float32 (bfloat16 has float32's range, so no loss scaling is
needed, but only 8 bits of precision: near 6 it cannot tell 6.2 from 6.22). Say which modules of a GPT give
bfloat16 outputs under autocast, then write the step's forward and backward as the trainer does, with the
loss computed in float32.
In the project: train.py, `start_processes` (the autocast context), `train_step` (`with ... autocast:`);
model.py, `GPT.forward`'s full path (`F.cross_entropy(logits.float(), ...)`) and the chunked loss (its sums
in float32).
The check builds model.py's GPT with loss_path="full" (model.GPT(config, loss_path="full")), the loss path
whose forward runs lm_head on every position; the trainer's default path, "chunked", computes the loss from
lm_head's weight a slice at a time and never calls lm_head as a module.
Check: python exercises/check.py 17
(the output dtype of every module, recorded by hooks while train.py's train_step runs under bf16 autocast, in
two GPTs of random depth and width; then your step's loss and gradients against train_step's with that
autocast, on the CPU)
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import model


def bf16_modules(gpt):
    """The names (as gpt.named_modules() gives them) of the modules of `gpt`, a model.GPT built with
    loss_path="full" (of any depth and width), whose output is bfloat16 when the trainer's step runs it under
    bf16 autocast; every other module that runs gives float32."""
    names = set()
    for name, module in gpt.named_modules():
        inside = ".attn" in name or ".mlp" in name  # after a matmul: bf16 flows on to the block's sum
        if isinstance(module, (nn.Linear, model.CausalSelfAttention, model.MLP)) or (
                isinstance(module, (nn.GELU, nn.Dropout)) and inside):
            names.add(name)
    return names


def bf16_step(gpt, x, y):
    """One micro-step as the trainer's: the forward of `gpt` under torch.autocast("cpu", dtype=torch.bfloat16),
    the mean next-token cross-entropy of its logits computed in float32, and backward. Returns the loss, a
    float32 tensor without gradient."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = gpt(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
    loss.backward()
    return loss.detach()
