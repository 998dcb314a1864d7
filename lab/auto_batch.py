"""data.batch_size=auto: the largest micro-batch that fits this GPU, chosen before the run starts.

plan.py's `memory_per_rank` estimates each rank's bytes (weights, gradients, optimizer, activations)
for a micro-batch; `resolve_batch_size` takes the largest power of two whose estimate fits with
headroom, and train.py's wrap_model then runs one trial step of it (`confirm_batch_size`), halving
it once if the GPU runs out after all. On a CPU it is one sentence: there is no memory limit to fit.
Loaded only when a run asks for it (docs/fsdp.md).
"""

import torch
import torch.distributed as dist

from config import ConfigError
from plan import memory_per_rank

# data.batch_size=auto leaves this share of the GPU's memory free beside the estimate: the estimate
# ran up to 12% low against measured peaks (docs/measurements.md), and the CUDA context, the
# allocator's fragmentation and NCCL's buffers are not in it.
AUTO_HEADROOM = 0.2


def auto_batch_size(model, block_size, sequences_per_rank, world_size, sharded, bf16, device_bytes):
    """data.batch_size=auto: the largest micro-batch, a power of two up to 64 sequences (plenty for
    a GPU's throughput; the ladder's cap too) that divides the `sequences_per_rank` of a step, whose
    memory_per_rank estimate fits in (1 - AUTO_HEADROOM) of `device_bytes`; 0 when not even one
    sequence fits."""
    budget = (1 - AUTO_HEADROOM) * device_bytes
    for sequences in (64, 32, 16, 8, 4, 2, 1):
        if sequences_per_rank % sequences == 0 and memory_per_rank(
                model, sequences * block_size, world_size, sharded, bf16,
                "cuda")["total"] <= budget:
            return sequences
    return 0


def resolve_batch_size(cfg, model, world_size, device, bf16, device_bytes=None):
    """(micro-batch, the line that says why) for data.batch_size=auto on `device`; `device_bytes`:
    the GPU's memory (None: asked of the GPU). A CPU, or a model that fits no micro-batch, is one
    sentence (ConfigError)."""
    if torch.device(device).type == "mps":  # its memory is the Mac's, shared with everything else
        raise ConfigError("data.batch_size=auto fits the micro-batch to a CUDA GPU's memory, and "
                          "this run is on Apple's MPS, whose memory the whole Mac shares; set "
                          "data.batch_size to a number (the quick start's is 8).")
    if torch.device(device).type != "cuda":
        raise ConfigError("data.batch_size=auto fits the micro-batch to a GPU's memory, and this "
                          "run is on the CPU, which has no such limit to fit; set data.batch_size "
                          "to a number (the quick start's is 8).")
    device_bytes = device_bytes or torch.cuda.get_device_properties(device).total_memory
    per_rank, rest = divmod(cfg.train.total_batch_size, cfg.model.block_size * world_size)
    sharded = cfg.train.data_parallel == "fsdp"
    chosen = auto_batch_size(model, cfg.model.block_size, per_rank, world_size, sharded, bf16,
                             device_bytes) \
        if not rest else 0
    mode = f"FSDP on {world_size}" if sharded else f"DDP on {world_size}"
    if not chosen:
        raise ConfigError("data.batch_size=auto found no micro-batch that divides "
                          f"train.total_batch_size={cfg.train.total_batch_size} tokens among "
                          f"{world_size} rank(s) of {cfg.model.block_size}-token sequences and "
                          f"fits {1 - AUTO_HEADROOM:.0%} of the GPU's {device_bytes / 1e9:.1f} GB "
                          f"with {mode}; use train.data_parallel=fsdp or more GPUs, or set "
                          "data.batch_size.")
    estimate = memory_per_rank(model, chosen * cfg.model.block_size, world_size, sharded, bf16,
                               "cuda")["total"]
    return chosen, (f"data.batch_size=auto: {chosen} sequences per rank per micro-step, the "
                    f"largest power of two up to 64 that fits: {estimate / 1e9:.1f} GB by the "
                    f"estimate ({mode}) within {1 - AUTO_HEADROOM:.0%} of the GPU's "
                    f"{device_bytes / 1e9:.1f} GB ({AUTO_HEADROOM:.0%} headroom)")


def confirm_batch_size(cfg, procs, raw_model):
    """data.batch_size=auto on a GPU: the estimate is an estimate, so one forward and backward of
    the chosen micro-batch runs before the first step; on an out-of-memory error the micro-batch is
    halved, once, with a warning (the ranks agree on the smaller). Nothing is trained: the gradients
    are dropped and the random state is put back. Under FSDP the ranks hold equal shares and so, as
    a rule, run out together; one that ran out alone would leave the others waiting in a collective
    until train.dist_timeout."""
    size, fits = cfg.data.batch_size, 1
    tokens = torch.zeros(size, cfg.model.block_size, dtype=torch.long, device=procs.device)
    with torch.random.fork_rng(devices=[procs.device]):
        try:
            with procs.autocast:
                loss = raw_model(tokens, tokens)
            loss.backward()
        except torch.OutOfMemoryError:
            fits = 0
        loss = None
    raw_model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    if procs.world_size > 1:
        agreed = torch.tensor(fits)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=procs.cpu_group)
        fits = int(agreed)
    if not fits and size > 1:
        cfg.data.batch_size = size // 2
        if procs.is_master:
            print(f"warning: data.batch_size=auto: {size} sequences ran out of GPU memory in a "
                  f"trial step, so the run takes {size // 2} (halved once; set data.batch_size to "
                  "choose it yourself).", flush=True)
