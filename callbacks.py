"""The trainer's monitors and helpers, each a plain function the loop calls at a visible place.

OLMo-core provides these as callback classes registered with its trainer. Here they are functions:
the loop in train.py says exactly when each one runs, and adding one takes five lines.

- speed: `StepClock` (step time between step ends, evaluation and checkpoint time apart), `speed_metrics`
  (tokens/s, sequences/s, step and data time, MFU, PFLOPs so far), and the GPU peak-FLOPs table for MFU
- stability: `per_layer_grad_norms`, `LossSpikeDetector`, `check_finite` (train.nan_policy); the activation and
  parameter statistics of log.activations_interval are debug.py's `activation_stats`
- system: `memory_metrics`, `GarbageCollector`, `make_profiler`, `save_environment`, `register_stack_dump` (what
  `python debug.py stacks RUN` reads), `Notifier` (a webhook told when the run starts and ends)
"""

import contextlib
import faulthandler
import gc
import json
import math
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from contextlib import nullcontext

import torch

from config import CHECKS, ConfigError, UserError, redact_argv
from plan import Every

# ----------------------------------------------------------------------------- speed


# Peak dense bf16 tensor-core FLOP/s from the vendors' datasheets, used for MFU (model FLOPs
# utilisation). Matched against `torch.cuda.get_device_name()`; `train.peak_flops` overrides it.
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


class StepClock:
    """Step time measured between consecutive step ends (OLMo-core's speed monitor, torchtitan and nanoGPT
    time steps the same way), so a run's step times add up to the loop's wall time: the host's waits for the
    GPU (collecting metrics, once every log.metrics_collect_interval steps) count in the step after them.
    Evaluation, checkpoint and sample time is measured apart (`aside`) and left out of the steps."""

    def __init__(self, device):
        self.synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        self.last_end = time.perf_counter()
        self.set_aside = {}  # kind -> seconds since the last step ended

    def lap(self):
        """At the end of a step: (its seconds, {kind: seconds set aside in its window})."""
        now = time.perf_counter()
        aside, self.set_aside = self.set_aside, {}
        step_time, self.last_end = now - self.last_end - sum(aside.values()), now
        return step_time, aside

    @contextlib.contextmanager
    def aside(self, kind):
        """Time a block that is not training. The GPU finishes the step's queued work before the clock starts and
        the block's own work before it stops, so neither spills into the other (two syncs, only around
        evaluations, checkpoints, samples and traces)."""
        self.synchronize()
        start = time.perf_counter()
        yield
        self.synchronize()
        self.set_aside[kind] = self.set_aside.get(kind, 0.0) + time.perf_counter() - start


def speed_metrics(*, step_time, data_time, tokens_per_step, block_size, tokens_seen, flops_per_token,
                  world_size, peak_flops):
    """Throughput of one step from its StepClock time (on a GPU the host runs ahead between syncs, so a
    single step is noisy, but the steps of a window between syncs add up to its wall time)."""
    tokens_per_sec = tokens_per_step / step_time
    values = {
        "throughput/tokens_per_sec": tokens_per_sec,
        "throughput/sequences_per_sec": tokens_per_sec / block_size,
        "throughput/step_time_sec": step_time,
        "throughput/data_time_sec": data_time,
        # OLMo's global_train_petaflops: training compute spent so far (trained tokens only), all ranks together.
        "throughput/total_petaflops": flops_per_token * tokens_seen / 1e15,
    }
    if peak_flops:
        # MFU (PaLM, appendix B): the model's training FLOP/s per device as a share of the device's peak.
        values["throughput/mfu"] = flops_per_token * tokens_per_sec / world_size / peak_flops
    return values


# ----------------------------------------------------------------------------- stability


def grad_norm(params):
    """The norm of the gradients of `params` taken together (those that have one), on the device."""
    grads = [p.grad.norm() for p in params if p.grad is not None]
    # FSDP: the norm of a rank's piece is a DTensor, and full_tensor() gives the whole gradient's (a small collective)
    grads = [norm.full_tensor() if hasattr(norm, "full_tensor") else norm for norm in grads]
    return torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.zeros(())


def per_layer_grad_norms(raw_model):
    """The gradient norm of the embeddings (grad/embedding) and of each block (grad/layerNN), to find which layer
    blows up. The model says which parameters are embeddings and which modules are its blocks."""
    norms = {"grad/embedding": grad_norm(raw_model.param_groups()["embedding"])}
    for i, block in enumerate(raw_model.blocks):
        norms[f"grad/layer{i:02d}"] = grad_norm(block.parameters())
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


class NonFiniteLoss(UserError):
    """Training produced NaN or Inf; the message says what to do."""


def nonfinite_stop(what, out_dir, skip=True):
    """NonFiniteLoss for `what` (what went non-finite, and where), with the way on that holds for this run: resume from
    its last checkpoint, or start again when it has none (a resume from nothing is no advice). `skip`: also offer
    train.nan_policy=skip (a run that skips already has its limit instead)."""
    from checkpoint import newest_checkpoint

    last = newest_checkpoint(out_dir) if out_dir else None
    restart = f"resume from its last checkpoint, {os.path.basename(last)}," if last else \
        "start again (the run has no checkpoint to resume)"
    then = ", or set train.nan_policy=skip to skip such steps" if skip else \
        " (train.nan_skip_limit sets how many in a row)"
    return NonFiniteLoss(f"{what}; {restart} with a lower optim.lr{then}.")


def nonfinite_message(step, values):
    """What is non-finite among host `values` (train/loss, train/grad_norm) and at which step, else None."""
    for name in ("train/loss", "train/grad_norm"):
        if name in values and not math.isfinite(values[name]):
            return f"{name} is {values[name]} at step {step}, so no checkpoint was saved after it"
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


def check_finite(step, values, out_dir=None):
    """NonFiniteLoss, naming `step`, if the step's train/loss or train/grad_norm is not finite."""
    message = nonfinite_message(step, host_values(values))
    if message:
        raise nonfinite_stop(message, out_dir)


# ----------------------------------------------------------------------------- system


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


class GarbageCollector:
    """Python's automatic GC pauses a rank at random moments, and with DDP every other rank waits for
    it. Disable it and collect on every rank at the same step instead (OLMo's GarbageCollector)."""

    def __init__(self, interval):
        self.interval, self.collections = interval, Every(interval)

    def __enter__(self):
        if self.interval:
            gc.disable()
        return self

    def __exit__(self, *exc):
        if self.interval:
            gc.enable()

    def step(self, step):
        if self.collections.due(step):
            gc.collect(1)


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


STACKS = "stacks"  # <out_dir>/stacks/: each rank's pid file and stack dumps
PROC = "/proc"  # where Linux tells each process's start time (see process_start_time)


def process_start_time(pid):
    """When process `pid` started, in clock ticks after boot (field 22 of /proc/<pid>/stat), or None when
    no such process runs. A pid is reused once its process ends; a (pid, start time) pair is not."""
    try:
        with open(os.path.join(PROC, str(pid), "stat")) as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2, the command name, is in parentheses and may hold spaces and ")": count from the last ")".
    return int(stat.rsplit(")", 1)[1].split()[19])


def register_stack_dump(out_dir, rank):
    """Write this rank's pid, host and start time, and dump its threads' stacks on SIGUSR1. Returns a
    function that undoes both (the pid file must not outlive the process). A no-op where SIGUSR1 does
    not exist (Windows)."""
    if not hasattr(signal, "SIGUSR1"):
        return lambda: None
    folder = os.path.join(out_dir, STACKS)
    os.makedirs(folder, exist_ok=True)
    pid_path = os.path.join(folder, f"rank{rank}.pid")  # the global rank: nodes sharing a folder never collide
    # The start time proves to `debug.py stacks` that the pid is still this rank's: after a kill -9 the
    # file stays behind, and the pid may go to a process that SIGUSR1 would kill (its default action).
    start_time = process_start_time(os.getpid()) if os.path.isdir(PROC) else None
    with open(pid_path, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "rank": rank, "start_time": start_time}, f)
    # Append mode: `debug.py stacks` empties the file before signalling, and the dump lands at its start.
    stacks_file = open(os.path.join(folder, f"rank{rank}.txt"), "a")
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)

    def undo():
        faulthandler.unregister(signal.SIGUSR1)
        stacks_file.close()
        if os.path.exists(pid_path):
            os.remove(pid_path)

    return undo


class Notifier:
    """log.slack_webhook, or the SLACK_WEBHOOK_URL environment variable (OLMo's Slack notifier): a short JSON message
    ({"text": ...}, Slack's incoming-webhook format) when the run starts, and when it finishes, is stopped early
    (a signal, CANCEL, the time limit) or fails. Rank 0 posts. A post that fails is a warning, never the run's end.
    A context manager: entered as the loop is about to start; on leaving, it posts `outcome`, or the error."""

    def __init__(self, url, name, is_master):
        url = url or os.environ.get("SLACK_WEBHOOK_URL", "")  # (log.slack_webhook is checked with the config)
        webhook = "an http:// or https:// URL, or empty"  # the setting's own check (config.py)
        if not CHECKS[webhook](url):  # on every rank, so that all stop
            raise ConfigError(f"the SLACK_WEBHOOK_URL environment variable must be {webhook} (its value is not shown: "
                              f"a secret); set it to the webhook's https:// URL, or unset it.")
        self.url = url if is_master else ""
        self.name, self.outcome = name, "ended"

    def post(self, text, ending=False):
        """Post `text`; `ending`: the run's last message (a failure is then not followed by "training goes on")."""
        if not self.url:
            return
        import urllib.request

        request = urllib.request.Request(self.url, data=json.dumps({"text": f"{self.name}: {text}"}).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except Exception as error:  # noqa: BLE001 - a notification is never worth the run
            print(f"warning: the run notifier could not post to its webhook ({type(error).__name__}: {error}); "
                  + ("the run's outcome is as printed above." if ending else "training goes on."), file=sys.stderr,
                  flush=True)

    def __enter__(self):
        self.post("started")
        return self

    def __exit__(self, kind, error, traceback):
        if error is None:
            self.post(self.outcome, ending=True)
        else:
            self.post(f"failed: {(str(error).splitlines() or [type(error).__name__])[0][:300]}", ending=True)
