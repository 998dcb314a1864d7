"""The model configurator: which GPT a ladder size name means, and how it fits on a device.

A size is named `<layers>x<width>`: `4x32` is 4 transformer blocks with a 32-wide residual stream.
Heads are 64 wide as in every GPT-2 (one head below 64), so a width is a multiple of 32 below 64 and
of 64 from there. Any such name is a size; two dials list the ones the shipped ladders use:

- On a GPU, GPT-2's own aspect ratio, 64 of width per layer: `4x256`, `6x384`, `8x512`, `10x640`,
  and `12x768`, which is GPT-2 (124M). GPT-2's larger shapes are here under their names too.
- On a CPU, width doubling at depth 2: `2x32`, `2x64`, `2x128`, `2x256`. With GPT-2's 50,304-token
  vocabulary a small model's time per token is mostly the output layer and its softmax over the
  vocabulary (on 2 cores at batch 512: about 4,500 tokens/s at 2x32, 2,300 at 2x128, 900 at 2x256),
  so N grows 4x per step of the dial for 1.3x to 2.5x the time per token. Doubling depth instead
  (2x64 to 4x64) did not lower the loss at these durations, so the fit saw no N effect
  (docs/ladder.md).

Parameter counts come from the run's own model (`train.model_module`, with the whole `model.*`
section, overrides kept, and only the shape set from the size), built on the meta device (no memory,
no initialisation), and asked what it has (`num_params`); nothing here names a layer, so a fork's
ladder counts the fork.
"""

import dataclasses
import math
import re

import torch

from checkpoint import gpt_class
from config import ConfigError, check_model

GPT2_SHAPES = {"gpt2": (12, 768), "gpt2-medium": (24, 1024), "gpt2-large": (36, 1280),
               "gpt2-xl": (48, 1600)}
CPU_DIAL = ["2x32", "2x64", "2x128", "2x256"]
GPU_DIAL = [f"{layers}x{64 * layers}" for layers in (4, 6, 8, 10, 12)]
# the named ones; any <layers>x<width> of the rule works
SIZES = CPU_DIAL + GPU_DIAL + list(GPT2_SHAPES)
PARAMS = ("non_embedding", "with_output", "total")  # what N counts (ladder.py fit --params)

# Memory of one device, GiB, for the rank micro-batch. `cpu` is a laptop's share, not the machine's
# RAM.
DEVICE_MEMORY_GIB = {"cpu": 8, "H100": 80, "H200": 141, "A100-80GB": 80, "A100-40GB": 40,
                     "L40S": 48, "A10G": 24,
                     "L4": 24, "RTX4090": 24, "T4": 16}


def shape_of(size):
    """(n_layer, n_embd) of a size name, or one sentence saying what a size is."""
    if size in GPT2_SHAPES:
        return GPT2_SHAPES[size]
    match = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)", size)
    width = int(match.group(2)) if match else 0
    if not match or width % (32 if width < 64 else 64):
        raise ConfigError(f"unknown model size {size!r}; a size is <layers>x<width> with a width "
                          "that is a multiple of 32 below 64 and of 64 from there (e.g. "
                          f"{', '.join(CPU_DIAL[:3])}), or one of {', '.join(GPT2_SHAPES)}.")
    return int(match.group(1)), width


def model_config(size, base):
    """The run's model section `base` (a GPTConfig, or a fork's) with the shape of `size`: n_layer
    and n_embd from the name, 64-wide heads. Every other field (block_size, a fork's own) stays as
    the run set it."""
    n_layer, n_embd = shape_of(size)
    return dataclasses.replace(base, n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64))


def sized_model(size, base, model_module="model"):
    """The run's GPT (`train.model_module`) at `size`, on the meta device: its counts without its
    memory."""
    try:
        cls = gpt_class(model_module)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    config = model_config(size, base)
    # (a shape the size gives may break a check: n_head=1, say)
    check_model(config, f"ladder size {size}: ")
    with torch.device("meta"):
        return cls(config)


def param_counts(model):
    """{non_embedding, with_output, total} parameters of a model, as it counts them
    (model.PARAM_KINDS). non_embedding is Kaplan et al.'s N (no token or position embeddings);
    with_output adds a tied output layer (which every token multiplies: nanochat's N, and Porian et
    al.'s point that it is real compute); total is every parameter once."""
    return {"non_embedding": model.num_params(non_embedding=True),
            "with_output": model.num_params_with_output(),
            "total": model.num_params()}


def device_memory_gib(device_type):
    if device_type not in DEVICE_MEMORY_GIB:
        raise ConfigError(f"ladder.device={device_type!r} is not a known device; use one of "
                          f"{', '.join(DEVICE_MEMORY_GIB)}.")
    return DEVICE_MEMORY_GIB[device_type]


def configure_rank_microbatch_size(model, device_type):
    """Tokens one device processes per micro-step (OLMo's configure_rank_microbatch_size): the
    largest power-of-two number of sequences whose activations fit beside the weights and AdamW
    state.

    Memory per device: 16 bytes per parameter (float32 weight, gradient and two AdamW moments), and
    per token and layer about 34 x width bytes of bf16 activations (Korthikanti et al. 2022, table
    2, with flash attention, which keeps no sequence x sequence scores); float32 on a CPU doubles
    it. The fused loss never holds the logits. Half the memory is left for the allocator, the
    compiler and the rest."""
    c, sequence_length = model.config, model.config.block_size
    budget = device_memory_gib(device_type) * 2**30 / 2 - 16 * model.num_params()
    bytes_per_token = 34 * c.n_embd * c.n_layer * (2 if device_type == "cpu" else 1) + 16 * c.n_embd
    sequences = max(1, budget // (bytes_per_token * sequence_length))
    # 64 sequences per device is plenty for throughput
    sequences = 2 ** int(math.log2(min(sequences, 64)))
    return sequences * sequence_length


def memory_fit(model, device_type, micro_batch_tokens, devices):
    """(GB per device with DDP, GB per device with FSDP on `devices`, the device's GB, "fits with
    DDP" / "needs FSDP" / "does not fit"): plan.memory_per_rank, the estimate a run prints at start,
    for this model."""
    from plan import memory_per_rank

    bf16, kind = device_type != "cpu", "cpu" if device_type == "cpu" else "cuda"
    ddp = memory_per_rank(model, micro_batch_tokens, devices, False, bf16, kind)["total"] / 1e9
    fsdp = memory_per_rank(model, micro_batch_tokens, devices, True, bf16, kind)["total"] / 1e9
    memory = device_memory_gib(device_type) * 2**30 / 1e9
    if ddp <= memory:
        verdict = "fits with DDP"
    elif fsdp <= memory:
        verdict = "needs FSDP"
    else:
        verdict = "does not fit"
    return ddp, fsdp, memory, verdict


def configure_minimal_device_mesh_spec(model, size, device_type):
    """(min_world_size, min_dp_world_size) as OLMo's configure_minimal_device_mesh_spec. This
    trainer is data-parallel (DDP): every device holds the whole model, so more devices never make a
    model fit; one device is the minimum when the weights and AdamW state fit in it, and none
    suffices otherwise."""
    total = model.num_params()
    if 16 * total > device_memory_gib(device_type) * 2**30 / 2:
        raise ConfigError(f"size {size} ({total:,} parameters) does not fit on one {device_type} "
                          "with DDP; pick a smaller size or a device with more memory.")
    return 1, None
