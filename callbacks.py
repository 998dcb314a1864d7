"""The trainer's monitors and helpers, each a plain function the loop calls at a visible place.

OLMo-core provides these as callback classes registered with its trainer. Here they are functions:
the loop in train.py says exactly when each one runs, and adding one takes five lines.

- run length: `duration_to_steps` (steps, tokens, epochs, Chinchilla multiples), `parse_step_ranges`
- speed: `speed_metrics` (tokens/s, sequences/s, step and data time, MFU, PFLOPs so far)
- stability: `per_layer_grad_norms`, `LossSpikeDetector`, `check_finite` (train.nan_policy)
- system: `memory_metrics`, `GarbageCollector`, `make_profiler`, `save_environment`
"""

import gc
import json
import math
import os
import platform
import re
import resource
import socket
import subprocess
import sys
from collections import deque
from contextlib import nullcontext

import torch

from configurator import ConfigError

# ----------------------------------------------------------------------------- run length

DURATION = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*(steps|tokens|epochs|chinchilla)\s*$")
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal ~20 tokens per parameter


def duration_to_steps(duration, tokens_per_step, tokens_per_epoch, non_embedding_params):
    """Convert train.max_duration ('5000steps', '2e9tokens', '3epochs', '1chinchilla') to optimizer
    steps, rounding up so the run sees at least that much data."""
    match = DURATION.match(duration.lower())
    if not match:
        raise ConfigError(f"train.max_duration={duration!r} is not a duration; write e.g. 5000steps, 2e9tokens, "
                          f"3epochs or 1chinchilla.")
    amount, unit = float(match.group(1)), match.group(2)
    if unit == "steps":
        return math.ceil(amount)
    tokens = {"tokens": amount, "epochs": amount * tokens_per_epoch,
              "chinchilla": amount * CHINCHILLA_TOKENS_PER_PARAM * non_embedding_params}[unit]
    return math.ceil(tokens / tokens_per_step)


def parse_step_ranges(text):
    """'100-200,5000-5010' -> [(100, 200), (5000, 5010)]: steps start..end-1 (1-based, as logged)."""
    ranges = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)-(\d+)", part)
        if not match or int(match.group(1)) >= int(match.group(2)):
            raise ConfigError(f"train.steps_to_skip part {part!r} is not a range; write e.g. 100-200,5000-5010.")
        ranges.append((int(match.group(1)), int(match.group(2))))
    return ranges


def in_ranges(step, ranges):
    return any(start <= step < end for start, end in ranges)


# ----------------------------------------------------------------------------- speed


def speed_metrics(step_time, data_time, tokens_per_step, block_size, tokens_seen, flops_per_token,
                  world_size, peak_flops):
    """Throughput of one step from host timings (on a GPU the host runs ahead between syncs, so single
    steps are noisy, but they add up to the wall time of every window between syncs)."""
    tokens_per_sec = tokens_per_step / step_time
    values = {
        "throughput/tokens_per_sec": tokens_per_sec,
        "throughput/sequences_per_sec": tokens_per_sec / block_size,
        "throughput/step_time_sec": step_time,
        "throughput/data_time_sec": data_time,
        # OLMo's global_train_petaflops: training compute spent so far, all ranks together.
        "throughput/total_petaflops": flops_per_token * tokens_seen / 1e15,
    }
    if peak_flops:
        values["throughput/mfu"] = flops_per_token * tokens_per_sec / world_size / peak_flops
    return values


# ----------------------------------------------------------------------------- stability


def per_layer_grad_norms(raw_model):
    """The gradient norm of each block (and the embedding), to find which layer blows up."""
    norms = {"grad/embedding": raw_model.transformer.wte.weight.grad.norm()}
    for i, block in enumerate(raw_model.transformer.h):
        grads = [p.grad for p in block.parameters() if p.grad is not None]
        norms[f"grad/layer{i:02d}"] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    return norms


class LossSpikeDetector:
    """Flags a logged loss that exceeds the mean of the previous `window` losses by `threshold` nats."""

    def __init__(self, threshold, window=50):
        self.threshold, self.recent = threshold, deque(maxlen=window)

    def is_spike(self, loss):
        spike = (self.threshold > 0 and len(self.recent) >= 10
                 and loss > sum(self.recent) / len(self.recent) + self.threshold)
        if math.isfinite(loss):
            self.recent.append(loss)
        return spike


class NonFiniteLoss(Exception):
    """Training produced NaN or Inf; the message says what to do."""


def check_finite(step, values):
    """train.nan_policy=stop: never keep training on garbage. Checked when metrics are collected."""
    for name in ("train/loss", "train/grad_norm"):
        if name in values and not math.isfinite(values[name]):
            raise NonFiniteLoss(f"{name} is {values[name]} at step {step}, so no checkpoint was saved after it; "
                                f"resume from the last checkpoint with a lower optim.lr, or set "
                                f"train.nan_policy=skip to skip such steps.")


# ----------------------------------------------------------------------------- system


def memory_metrics(device):
    if torch.device(device).type == "cuda":
        gib = 2**30
        return {"system/gpu_memory_allocated_gb": torch.cuda.memory_allocated(device) / gib,
                "system/gpu_memory_reserved_gb": torch.cuda.memory_reserved(device) / gib,
                "system/gpu_memory_peak_gb": torch.cuda.max_memory_allocated(device) / gib}
    with open("/proc/self/statm") as f:  # Linux; resident pages are the second number
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"system/cpu_rss_gb": rss / 2**30, "system/cpu_rss_peak_gb": peak_kb / 2**20}


class GarbageCollector:
    """Python's automatic GC pauses a rank at random moments, and with DDP every other rank waits for
    it. Disable it and collect on every rank at the same step instead (OLMo's GarbageCollector)."""

    def __init__(self, interval):
        self.interval = interval
        if interval:
            gc.disable()

    def step(self, step):
        if self.interval and step % self.interval == 0:
            gc.collect(1)

    def close(self):
        if self.interval:
            gc.enable()


def make_profiler(enabled, out_dir, rank, wait, warmup, active):
    """torch.profiler over one window of steps; the trace (chrome://tracing, Perfetto, TensorBoard)
    lands in <out_dir>/profiler/. The loop calls profiler.step() after every step."""
    if not enabled:
        return nullcontext(type("NoProfiler", (), {"step": lambda self: None})())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(os.path.join(out_dir, "profiler"),
                                                               worker_name=f"rank{rank}"),
    )


def save_environment(out_dir, world_size):
    """What produced this run, beside config.json: the code version and the software and hardware."""
    repo = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    env = {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "command": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "host": socket.gethostname(),
        "world_size": world_size,
    }
    with open(os.path.join(out_dir, "environment.json"), "w") as f:
        json.dump(env, f, indent=2)
