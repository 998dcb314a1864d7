"""Stopping early and cleanly: on SIGTERM/SIGINT, a CANCEL file, or a wall-clock limit.

Cluster schedulers preempt a job with SIGTERM; a person presses Ctrl-C; a script touches
`<out_dir>/CANCEL`; a job has a time limit. In every case the loop finishes the current step, saves a
checkpoint and exits, so at most one step is lost. Ranks may see the cause at different moments (a
signal reaches them one by one, only rank 0 looks for the file), so every `train.cancel_check_interval`
steps (default 1) they agree: one tiny all-reduce on a CPU (gloo) group, which never waits for the GPU.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from plan import Every

REASONS = ("", "signal", "cancel file", "time limit", "write error")  # index 0: keep training


class SignalFlag:
    """Remembers the first SIGTERM/SIGINT; a second SIGINT exits at once. A context manager: the
    handlers it replaced come back when the run ends (train.train may run inside another program)."""

    def __init__(self):
        self.received = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None and signum == signal.SIGINT:
            print("second SIGINT: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(130)
        self.received = name
        print(f"{name} received: finishing this step, saving a checkpoint, then exiting "
              f"(Ctrl-C again exits at once)", file=sys.stderr, flush=True)


class Stopper:
    """`poll(step)` after every step: the reason to stop now that the ranks agree on, or "". They agree
    every `check_interval` steps (one small collective) and at no other step."""

    def __init__(self, flag, out_dir, time_limit, check_interval, is_master, sinks=None, group=None):
        self.flag, self.out_dir, self.time_limit, self.checks = flag, out_dir, time_limit, Every(check_interval)
        self.is_master, self.sinks, self.group = is_master, sinks, group
        self.start_time = time.monotonic()

    def poll(self, step):
        if not self.checks.due(step):
            return ""
        return agree_on_stop(local_stop_reason(self.flag, self.out_dir, self.start_time, self.time_limit,
                                               self.is_master, self.sinks), self.group)

    def describe(self, reason):
        return describe_stop(reason, self.flag, self.out_dir)


def local_stop_reason(flag, out_dir, start_time, time_limit, is_master, sinks=None):
    if sinks is not None and sinks.failed:  # rank 0 cannot write its metrics: save what can be saved, then stop
        return "write error"
    if flag.received:
        return "signal"
    if is_master and os.path.exists(os.path.join(out_dir, "CANCEL")):
        return "cancel file"
    if time_limit and time.monotonic() - start_time > time_limit:
        return "time limit"
    return ""


def agree_on_stop(reason, group=None):
    """The reason to stop that any rank has (all ranks call this at the same steps)."""
    if not dist.is_initialized():
        return reason
    code = torch.tensor([REASONS.index(reason)], dtype=torch.int32)
    dist.all_reduce(code, op=dist.ReduceOp.MAX, group=group)
    return REASONS[int(code)]


def describe_stop(reason, flag, out_dir):
    if reason == "signal":
        return f"stopped by {flag.received or 'a signal on another rank'}"
    if reason == "cancel file":  # (train.py removes the file once the checkpoint is saved)
        return f"canceled by {os.path.join(out_dir, 'CANCEL')} (now removed)"
    return "stopped at the time limit (train.time_limit)"
