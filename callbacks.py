"""The trainer's monitors, each a plain function the loop calls at a visible place: OLMo-core's callback classes,
without the registry, so that train.py says exactly when each one runs.

- speed: the GPU peak-FLOPs table for MFU (the step's clock and speed metrics are metrics.py's)
- stability: `LossSpikeDetector`, the non-finite checks (train.nan_policy; the stop's error is step_extras.py's);
  per-layer gradient norms are step_extras.py's, activation and parameter statistics debug.py's `activation_stats`
- system: `memory_metrics`, `save_environment`; the stack dumps are stack_dump.py's, the webhook notifier.py's, the
  garbage collector and the profiler step_extras.py's
"""

import json
import math
import os
import platform
import resource
import socket
import subprocess
import sys
from collections import deque

import torch

from config import redact_argv


# Peak dense bf16 tensor-core FLOP/s from the vendors' datasheets, for MFU; train.peak_flops overrides the table.
PEAK_BF16_FLOPS = {  # first match wins, so the PCIe variant comes before the SXM name it contains
    "A100": 312e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,
}


def peak_flops_for_device(device, override=0.0):
    """Peak bf16 FLOP/s of `device`, or None when unknown (CPUs, unlisted GPUs): MFU is then not logged."""
    if override > 0:
        return override
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for gpu, flops in PEAK_BF16_FLOPS.items() if gpu in name), None)


class LossSpikeDetector:
    """Flags a logged loss that exceeds the mean of the previous `window` losses by `threshold` nats."""

    def __init__(self, threshold, window=50):
        self.threshold, self.recent = threshold, deque(maxlen=window)

    def flag(self, rows):
        """Mark train/loss_spike in each of the host rows [(step, {name: value})] whose train/loss is a spike."""
        for _, values in rows:
            loss = values.get("train/loss")
            if loss is None:
                continue
            if (self.threshold > 0 and len(self.recent) >= 10
                    and loss > sum(self.recent) / len(self.recent) + self.threshold):
                values["train/loss_spike"] = 1.0
            if math.isfinite(loss):
                self.recent.append(loss)


def nonfinite_message(step, values):
    """What is non-finite among host `values` (train/loss, train/grad_norm) and at which step, else None."""
    for name in ("train/loss", "train/grad_norm"):
        if name in values and not math.isfinite(values[name]):
            return f"{name} is {values[name]} at step {step}, so no checkpoint was saved after it"
    return None


def first_nonfinite(rows):
    """The sentence for the first NaN/Inf train/loss or train/grad_norm among host rows [(step, values)], else None."""
    for step, values in rows:
        if not all(math.isfinite(values[name]) for name in ("train/loss", "train/grad_norm") if name in values):
            return nonfinite_message(step, values)
    return None


def host_values(values):
    """train/loss and train/grad_norm of `values` (which may be device tensors) on the host: one sync for both."""
    names = [name for name in ("train/loss", "train/grad_norm") if name in values]
    if not names:
        return {}
    return dict(zip(names, torch.stack([torch.as_tensor(values[name]).float().reshape(()) for name in names]).tolist()))


def all_finite(values):
    """Whether the step's train/loss and train/grad_norm are finite: one host sync, so the loop asks only when
    something is about to read the weights (train.nan_policy=stop never keeps training on garbage)."""
    return nonfinite_message(0, host_values(values)) is None


def memory_metrics(device):
    """Memory in GiB: on a GPU what PyTorch's allocator holds, on a CPU the process's resident set."""
    if torch.device(device).type == "cuda":
        gib = 2**30
        return {"system/gpu_memory_allocated_gb": torch.cuda.memory_allocated(device) / gib,
                "system/gpu_memory_reserved_gb": torch.cuda.memory_reserved(device) / gib,
                "system/gpu_memory_peak_gb": torch.cuda.max_memory_allocated(device) / gib}
    # ru_maxrss is in KiB on Linux and in bytes on macOS. The kernel updates this high-water mark lazily,
    # so it can read below the current resident set a moment after memory grew: the peak is the larger.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    values = {}
    if os.path.exists("/proc/self/statm"):  # Linux (macOS has no /proc): resident pages are the second number
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        values["system/cpu_rss_gb"] = rss / 2**30
        peak = max(peak, rss)
    values["system/cpu_rss_peak_gb"] = peak / 2**30
    return values


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
        "command": redact_argv(sys.argv),  # a secret on the command line (log.slack_webhook) is "***"
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "host": socket.gethostname(),
        "world_size": world_size,
    }
    with open(os.path.join(out_dir, "environment.json"), "w") as f:
        json.dump(env, f, indent=2)
