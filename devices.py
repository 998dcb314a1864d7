"""The table of devices: what runs where, one row per kind of device (CUDA, Apple's MPS, the
CPU), everything the trainer does differently on it. train.py reads the row once at start-up
(`device_kind`); `pick_device` resolves train.device=auto. Adding a device is adding a row.
"""

import os
import re
import resource
import sys
from dataclasses import dataclass

import torch

from config import UserError

# One row per kind of device: everything the trainer does differently on it. The rest of the
# trainer asks the row (`device_kind`) once, at start-up; adding a device is adding a row.

GIB = 2**30
# Peak dense bf16 FLOP/s of known GPUs (vendor datasheets), for MFU; the first name found in
# torch.cuda.get_device_name counts, so a longer name comes before the name it contains.
PEAK_BF16_FLOPS = {
    "A100": 312e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H200": 989e12,
}


def cuda_memory(device):
    """What PyTorch's CUDA allocator holds, in GiB."""
    return {"system/gpu_memory_allocated_gb": torch.cuda.memory_allocated(device) / GIB,
            "system/gpu_memory_reserved_gb": torch.cuda.memory_reserved(device) / GIB,
            "system/gpu_memory_peak_gb": torch.cuda.max_memory_allocated(device) / GIB}


def mps_memory(device):
    """What PyTorch's MPS allocator holds and what Metal's driver has given the process, in GiB
    (MPS keeps no peak)."""
    return {"system/gpu_memory_allocated_gb": torch.mps.current_allocated_memory() / GIB,
            "system/gpu_memory_reserved_gb": torch.mps.driver_allocated_memory() / GIB}


def cpu_memory(device):
    """The process's resident set and its peak, in GiB."""
    # ru_maxrss is in KiB on Linux and in bytes on macOS. The kernel updates this high-water mark
    # lazily, so it can read below the current resident set just after memory grew.
    unit = 1 if sys.platform == "darwin" else 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    values = {}
    if os.path.exists("/proc/self/statm"):  # Linux: resident pages are the second number
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        values["system/cpu_rss_gb"] = rss / GIB
        peak = max(peak, rss)
    values["system/cpu_rss_peak_gb"] = peak / GIB
    return values


# The memory files of each cgroup version, as the kernel's cgroup docs name them: the hierarchy's
# folder under /sys/fs/cgroup, the limit, the use, and memory.stat's line of the file cache the
# kernel drops first. v2: Documentation/admin-guide/cgroup-v2.rst; v1: .../cgroup-v1/memory.rst.
CGROUP_MEMORY = {"v2": ("", "memory.max", "memory.current", "inactive_file"),
                 "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                        "total_inactive_file")}
NO_LIMIT = 2**62  # v1 writes "no limit" as 9223372036854771712 (2**63 - 1 cut to whole pages)


def read_number(path, line_name=None):
    """The number in a cgroup file (of its line `line_name`, in memory.stat), or None: missing,
    unreadable, or not a number (v2 writes "max" for no limit)."""
    try:
        with open(path) as f:
            text = f.read()
        if line_name is not None:
            text = next((line.split()[1] for line in text.splitlines()
                         if line.split()[:1] == [line_name]), "")
        return int(text)
    except (OSError, ValueError, IndexError):
        return None


def cgroup_memory_left(proc="/proc", cgroup_root="/sys/fs/cgroup"):
    """The bytes this process's memory cgroups still let it have, or None where none limits it.
    In a container (Docker, Kubernetes, a Slurm job) /proc/meminfo shows the host's memory, while
    the kernel ends the process at its cgroup's limit. /proc/self/cgroup names the cgroup (v2: the
    `0::/path` line; v1: the line that names `memory`); its limit and each one above it hold (a
    cgroup's use counts in its parents'), so the smallest headroom counts. The use leaves out the
    file cache the kernel drops first (inactive_file, as Kubernetes counts a container's working
    set). A missing or unreadable file is no limit from there."""
    try:
        with open(os.path.join(proc, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    left = []
    for line in lines:
        if line.count(":") < 2:
            continue
        number, controllers, path = line.split(":", 2)
        if number == "0" and not controllers:
            version = "v2"
        elif "memory" in controllers.split(","):
            version = "v1"
        else:
            continue
        hierarchy, limit_file, use_file, cache_line = CGROUP_MEMORY[version]
        parts = [part for part in path.split("/") if part]
        # The root, then each cgroup down to the process's: a container often sees its own cgroup
        # as the root, while /proc/self/cgroup names it by the host's path.
        for depth in range(len(parts) + 1):
            folder = os.path.join(cgroup_root, hierarchy, *parts[:depth])
            limit = read_number(os.path.join(folder, limit_file))
            if limit is None or limit >= NO_LIMIT:
                continue
            used = read_number(os.path.join(folder, use_file)) or 0
            cache = read_number(os.path.join(folder, "memory.stat"), cache_line) or 0
            left.append(max(0, limit - max(0, used - cache)))
    return min(left, default=None)


def cpu_capacity(device):
    """The bytes of memory this process can still get, not the machine's total: what the kernel
    says is available (MemAvailable: free memory and caches it can drop; the total without
    /proc), and no more than its memory cgroups (a container's limit, cgroup_memory_left) or its
    address-space limit (`ulimit -v`, RLIMIT_AS) leave beyond what the process maps already."""
    page = os.sysconf("SC_PAGE_SIZE")
    have = page * os.sysconf("SC_PHYS_PAGES")
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            available = [line.split()[1] for line in f if line.startswith("MemAvailable:")]
        have = int(available[0]) * 1024 if available else have  # (in kB)
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        mapped = 0
        if os.path.exists("/proc/self/statm"):  # Linux: the pages mapped are the first number
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * page
        have = min(have, max(0, limit - mapped))
    cgroup_left = cgroup_memory_left()
    return have if cgroup_left is None else min(have, cgroup_left)


def cuda_peak_flops(device):
    name = torch.cuda.get_device_name(device)
    return next((flops for gpu, flops in PEAK_BF16_FLOPS.items() if gpu in name), None)


def prepare_cuda(device):
    if torch.device(device).index is not None:
        torch.cuda.set_device(device)  # (under torchrun: this rank's GPU)
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls for the few float32 ones left


def nothing(*args):
    return None


@dataclass(frozen=True)
class DeviceKind:
    """A row of the table: how the trainer uses one kind of device."""
    name: str  # torch's device type
    what: str  # its name in a sentence
    available: object  # () -> whether this torch sees one
    count: object  # () -> how many there are (name:N numbers them from 0)
    # torch.distributed's backend for one process per device (torchrun); None: one process only
    backend: str | None
    prepare: object  # device -> None: the process's settings for it, once, before the model
    # () -> None: waits for the queued work, so the step clock stops when the work is done (a CPU's
    # work is done when its call returns: `nothing` to wait for)
    synchronize: object
    # () -> an event recorded after a copy to the host, so the copy overlaps the next steps (None:
    # the copy waits)
    copy_event: object
    memory: object  # device -> {system/... metric: GiB}
    autocast_dtype: object  # () -> the dtype train.dtype=auto autocasts to (None: float32)
    peak_flops: object  # device -> peak bf16 FLOP/s; None: unknown, so MFU is not printed
    pin_memory: bool  # batches leave pinned host memory, so the copy runs beside the compute
    compile: bool  # torch.compile under train.compile=auto
    fused_optimizer: bool  # AdamW's fused kernel: all tensors in one launch
    compiled_loss_path: str  # train.loss_path=auto under torch.compile (without it: chunked)
    # () -> the device's random state (dropout draws from it) for checkpoints, None while unused;
    # None: no generator of its own (the CPU's is torch's global one, saved apart)
    rng_state: object
    set_rng_state: object  # state -> None: a resumed run draws the same numbers
    # device -> the bytes of memory this process can get on it, for the check that a model's
    # weights fit before it is built (None: unknown, not checked)
    capacity: object = nothing


# In the order train.device=auto picks them (a single process; under torchrun, the first whose
# backend runs several processes). The loss paths and compile: docs/measurements.md.
DEVICES = {
    "cuda": DeviceKind(
        name="cuda", what="CUDA GPU", available=torch.cuda.is_available,
        count=torch.cuda.device_count, backend="nccl", prepare=prepare_cuda,
        synchronize=torch.cuda.synchronize, copy_event=torch.cuda.Event, memory=cuda_memory,
        autocast_dtype=lambda: torch.bfloat16 if torch.cuda.is_bf16_supported() else None,
        peak_flops=cuda_peak_flops, pin_memory=True, compile=True, fused_optimizer=True,
        compiled_loss_path="full", set_rng_state=torch.cuda.set_rng_state,
        capacity=lambda device: torch.cuda.mem_get_info(device)[0],  # free: other processes' taken
        rng_state=lambda: torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None),
    # Apple silicon, in one process (PyTorch has no distributed backend for it). Not run on a Mac
    # here (tests/test_devices.py stands in for one), so the choices every MPS supports: float32,
    # no compile, no fused AdamW; Apple publishes no peak FLOP/s to measure MFU against. Its checks
    # and calls are looked up at each call, so that tests/test_devices.py can stand in for them.
    "mps": DeviceKind(
        name="mps", what="Apple GPU (MPS)", available=lambda: torch.backends.mps.is_available(),
        count=lambda: 1, backend=None, prepare=nothing, synchronize=lambda: torch.mps.synchronize(),
        copy_event=None, memory=mps_memory, autocast_dtype=nothing, peak_flops=nothing,
        pin_memory=False, compile=False, fused_optimizer=False, compiled_loss_path="chunked",
        rng_state=lambda: torch.mps.get_rng_state() if torch.backends.mps.is_available() else None,
        set_rng_state=lambda state: torch.mps.set_rng_state(state)),
    "cpu": DeviceKind(
        name="cpu", what="CPU", available=lambda: True, count=lambda: 1, backend="gloo",
        prepare=nothing, synchronize=nothing, copy_event=None, memory=cpu_memory,
        autocast_dtype=nothing, peak_flops=nothing, pin_memory=False, compile=False,
        # fused AdamW: one vectorised pass over the 7 M parameters of the quick start, 3.5x faster
        # than the per-tensor loops on one core (docs/measurements.md)
        fused_optimizer=True, compiled_loss_path="chunked", rng_state=None, set_rng_state=None,
        capacity=cpu_capacity),
}


def device_kind(device):
    """The table's row for `device` (a string or torch.device)."""
    return DEVICES[torch.device(device).type]


def pick_device(choice, key="--device", processes=1):
    """`choice` (auto, cpu, mps, cuda or cuda:N) as the device this process uses: auto is the
    first kind this machine has that runs `processes` processes. One sentence, before anything is
    written, for a device this torch does not see or that cannot run that many."""
    if choice == "auto":
        return next(name for name, kind in DEVICES.items()
                    if kind.available() and (processes == 1 or kind.backend))
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", choice):
        raise UserError(f"{key}={choice} is not a device; give auto, cpu, mps, cuda or cuda:N.")
    kind = device_kind(choice)
    if not kind.available():
        raise UserError(f"{key}={choice} but this torch sees no {kind.what}; give {key}=cpu.")
    index = torch.device(choice).index
    if index is not None and index >= kind.count():
        raise UserError(f"{key}={choice} but this machine has {kind.count()} {kind.what}(s), "
                        "numbered from 0; give one of them.")
    if processes > 1 and kind.backend is None:
        raise UserError(f"{key}={choice} runs in one process: PyTorch has no distributed "
                        f"backend for a {kind.what}, so no DDP or FSDP across processes; run "
                        f"`python train.py` without torchrun, or give {key}=cpu.")
    return choice
