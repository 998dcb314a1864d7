"""Run under torchrun (test_fsdp.py, and by hand for docs/fsdp.md's figures): each rank's peak memory at the start of a
run, and FSDP's initial weights against a whole build's (DDP's).

    torchrun --nproc-per-node=2 tests/fsdp_start.py MODE [model overrides ...]     MODE: ddp or fsdp

Each rank first builds a tiny model the same way (imports, process group, allocator warmed up), reads its peak
resident set (RSS: the CPU's memory; ru_maxrss), then builds the model of the overrides through train.py's
build_model and wrap_model, and reads it again: the difference is what the model cost at its start. The bound for
FSDP is (1/world_size of the model + its largest tensor) x 1.2, in fp32: what sharded initialisation holds
at most, a rank's pieces plus the one whole tensor being initialised, with 20% for the allocator. Then, for FSDP,
every rank gathers the whole initial weights and compares them with a whole build from the same seed. Each rank
prints one line of JSON: {"rank", "mode", "params", "whole_mb", "largest_mb", "bound_mb", "peak_mb", "equal"}.
"""

import json
import resource
import sys

import torch
import torch.distributed as dist

import train
from config import parse_args

TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
        "--model.vocab_size=64"]


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def start(mode, overrides, procs=None):
    """(cfg, procs, raw model, model) of a run's start: train.py's build_model and wrap_model, nothing else."""
    cfg = parse_args([f"--train.data_parallel={mode}", "--train.compile=false", "--train.device=cpu", *overrides])
    procs = procs or train.start_processes(cfg)
    raw_model, record, _ = train.build_model(cfg, procs)
    model, _ = train.wrap_model(cfg, procs, raw_model, record)
    return cfg, procs, raw_model, model


def main(mode, overrides):
    _, procs, _, _ = start(mode, TINY)
    before = peak_mb()
    cfg, procs, raw_model, model = start(mode, overrides, procs)
    peak = peak_mb() - before
    params = sum(p.numel() for p in raw_model.parameters())
    largest = max(p.numel() for p in raw_model.parameters())
    whole_mb, largest_mb = params * 4 / 2**20, largest * 4 / 2**20
    equal = None
    if mode == "fsdp":  # the initial weights, gathered whole, against a whole build's from the same seed
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sharded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        ddp_cfg = parse_args(["--train.data_parallel=ddp", "--train.compile=false", *overrides])
        whole, _, _ = train.build_model(ddp_cfg, procs)
        equal = all(torch.equal(tensor, sharded[name]) for name, tensor in whole.state_dict().items())
    print(json.dumps({"rank": procs.rank, "mode": mode, "params": params, "whole_mb": round(whole_mb, 1),
                      "largest_mb": round(largest_mb, 1),
                      "bound_mb": round((whole_mb / procs.world_size + largest_mb) * 1.2, 1),
                      "peak_mb": round(peak, 1), "equal": equal}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
