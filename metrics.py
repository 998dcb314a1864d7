"""Metrics: recorded on the device every step, reduced across ranks and written out in batches.

`recorder.record_all({"train/loss": loss, ...})` keeps the tensors on the device, so recording costs no host-device
sync. Every `log.metrics_collect_interval` steps (OLMo-core's) `collect()` reduces the pending values of all ranks in
one collective and copies them to the host in one transfer; with `log.async_bookkeeping` (OLMo's), on a background
thread over a CPU (gloo) group. `RowWriter` writes the rows to `Sinks` (metrics.jsonl, W&B, `metrics_step<N>.json`
at evaluations) and returns their console lines, printed on rank 0. Names are namespaced: train/, val/, optim/,
throughput/, system/, grad/, data/, eval/ (tasks). `python tools/plot_metrics.py RUN_DIR [RUN_DIR ...]` plots them.
"""

import contextlib
import json
import os
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from callbacks import first_nonfinite
from config import UserError
from plan import Every

REDUCTIONS = ("mean", "sum", "max", "l2_norm", None)  # how ranks' values combine; None: rank 0's value
COMBINE = {"mean": lambda old, new: (old + new) / 2, "sum": torch.add, "max": torch.maximum, "min": torch.minimum}
MERGES = ("warn", "latest", "oldest", *COMBINE)  # a metric recorded twice in a step


class MetricRecorder:
    """Records a step's metrics on the device; `finish_step` collects them every so often and hands the
    rows to `on_rows` (a RowWriter in training), on this thread or, with async bookkeeping, the worker's."""

    def __init__(self, device, world_size=1, async_bookkeeping=False, bookkeeping_group=None, on_rows=None,
                 soft_timeout=30.0):
        self.device, self.world_size, self.on_rows = device, world_size, on_rows
        self.soft_timeout = soft_timeout  # log.bookkeeping_soft_timeout: a collection or a wait longer warns
        self.step_values = {}  # name -> the (merged) value recorded in the current step
        self.reductions = {}  # name -> how ranks combine it; fixed by the first record
        self.pending = []  # (step, {name: value}) not yet collected
        self.group = bookkeeping_group  # async bookkeeping's own gloo group: apart from the loop's collectives
        self.worker = ThreadPoolExecutor(max_workers=1) if async_bookkeeping else None
        self.in_flight = None

    def record_metric(self, name, value, reduce="mean", merge="warn"):
        """Record `value` (a tensor or number) for this step. `reduce` says how ranks combine: mean, sum, max,
        l2_norm (sqrt of the sum of squares: for norms computed per rank) or None (rank 0's value). A metric recorded
        twice in a step is merged as OLMo-core does: warn (keep the first, with a warning), latest, oldest, mean (of
        the two), sum, max, min. Merging is tensor arithmetic: no host sync."""
        self.record_all({name: value}, reduce, merge)

    def record_all(self, values, reduce="mean", merge="warn"):
        """record_metric for each of {name: value}, in one call (the loop records a step's metrics so)."""
        assert reduce in REDUCTIONS and merge in MERGES, (reduce, merge)
        for name, value in values.items():
            if self.reductions.setdefault(name, reduce) != reduce:
                raise ValueError(f"metric {name} was recorded with reduce={self.reductions[name]!r} and now with "
                                 f"reduce={reduce!r}; a metric must keep one reduce type.")
            value = value.detach() if torch.is_tensor(value) else value
            if name not in self.step_values or merge == "latest":
                self.step_values[name] = value
            elif merge == "warn":
                warnings.warn(f"metric {name} recorded twice in one step; keeping the value already recorded")
            elif merge != "oldest":
                old, new = (torch.as_tensor(v, dtype=torch.float64, device=self.device)
                            for v in (self.step_values[name], value))
                self.step_values[name] = COMBINE[merge](old, new)

    def get(self, name):
        """This step's value of `name` as it will be logged (merged, then reduced over the ranks: OLMo-core's
        get_metric), a float, or None if not recorded this step. For a callback or a fork that acts on it (a loss
        threshold, a custom stop): one collective and one host sync, so ask only when needed, on every rank alike."""
        if name not in self.step_values:
            return None
        value = torch.as_tensor(self.step_values[name], dtype=torch.float64, device=self.device).reshape(1)
        if self.world_size > 1:
            value = self._reduce(value, [self.reductions[name]], group=None)
        return value.item()

    def finish_step(self, step, collect, wait=False):
        """End `step`; with `collect`, reduce every pending step over the ranks and pass the rows to `on_rows`; with
        `wait` too, return once they are handled (metrics.jsonl then holds every step so far: the loop asks for that
        before a checkpoint). Returns the console lines `on_rows` returned here, or [] (none collected, or async)."""
        if self.step_values:
            self.pending.append((step, self.step_values))
        self.step_values = {}
        if not collect:
            return []
        start = time.perf_counter()
        if self.worker is None:
            lines = self.on_rows(self.collect())
        else:
            lines = []
            self.collect_in_background(self.on_rows)
            if wait:
                self.wait()
        warn_if_slow(f"collecting the metrics of step {step}", time.perf_counter() - start, self.soft_timeout)
        return lines

    def collect(self):
        """Reduce every pending metric over ranks: one collective, one copy to the host.
        Returns [(step, {name: float}), ...] in step order. Every rank must call it together."""
        packed = self._pack()
        if packed is None:
            return []
        labels, values, kinds = packed
        if self.world_size > 1:  # one rank has nothing to combine
            values = self._reduce(values, kinds, group=None)
        return self._rows(labels, values.tolist())

    def collect_in_background(self, handle_rows):
        """Async bookkeeping: collect() and handle_rows(rows) on the worker thread; raises the prior batch's error."""
        self.wait()
        packed = self._pack()
        if packed is None:
            return
        labels, values, kinds = packed
        host_values = values.to("cpu", non_blocking=True)  # the copy overlaps with the next steps
        copied = torch.cuda.Event() if values.is_cuda else None
        if copied is not None:
            copied.record()

        def finish():
            if copied is not None:
                copied.synchronize()
            values = self._reduce(host_values, kinds, self.group) if self.world_size > 1 else host_values
            handle_rows(self._rows(labels, values.tolist()))

        self.in_flight = self.worker.submit(finish)

    def wait(self):
        """Wait for async bookkeeping in flight (before a checkpoint, at the end); re-raise its error."""
        if self.in_flight is not None:
            in_flight, self.in_flight = self.in_flight, None
            in_flight.result()

    def close(self):
        if self.worker is not None:
            self.worker.shutdown(wait=True)

    def _pack(self):
        """All pending values as one float64 vector on the device (no sync)."""
        entries = [(step, name, value) for step, metrics in self.pending for name, value in sorted(metrics.items())]
        self.pending = []
        if not entries:
            return None
        # float64 keeps large counts (tokens, FLOPs) exact. Device tensors stack in place; host numbers go in one copy.
        values = torch.empty(len(entries), dtype=torch.float64, device=self.device)
        on_device = [i for i, (_, _, v) in enumerate(entries) if torch.is_tensor(v)]
        on_host = [i for i, (_, _, v) in enumerate(entries) if not torch.is_tensor(v)]
        if on_device:
            values[on_device] = torch.stack([entries[i][2].to(self.device, torch.float64).reshape(())
                                             for i in on_device])
        if on_host:
            values[on_host] = torch.tensor([float(entries[i][2]) for i in on_host], dtype=torch.float64).to(self.device)
        labels = [(step, name) for step, name, _ in entries]
        return labels, values, [self.reductions[name] for _, name in labels]

    def _reduce(self, values, kinds, group):
        """Combine every rank's vector with one all-gather, each entry by its own reduction."""
        device = values.device
        squared = torch.tensor([k == "l2_norm" for k in kinds], device=device)
        values = torch.where(squared, values * values, values)
        gathered = torch.empty(self.world_size * len(values), dtype=values.dtype, device=device)
        # all_gather_single is torch 2.13's name for all_gather_into_tensor, which now warns on every call
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(gathered, values, group=group)
        gathered = gathered.view(self.world_size, -1)
        is_max = torch.tensor([k == "max" for k in kinds], device=device)
        is_mean = torch.tensor([k == "mean" for k in kinds], device=device)
        is_rank0 = torch.tensor([k is None for k in kinds], device=device)
        summed = gathered.sum(0)
        values = torch.where(is_max, gathered.max(0).values, torch.where(is_mean, summed / self.world_size, summed))
        values = torch.where(is_rank0, gathered[0], values)
        return torch.where(squared, values.clamp_min(0).sqrt(), values)

    @staticmethod
    def _rows(labels, values):
        rows = {}
        for (step, name), value in zip(labels, values):
            rows.setdefault(step, {})[name] = value
        return sorted(rows.items())


def warn_if_slow(what, seconds, soft_timeout):
    """log.bookkeeping_soft_timeout (OLMo-core's): bookkeeping that holds the loop this long is said, with its time."""
    if seconds > soft_timeout:
        print(f"warning: {what} took {seconds:.3g} s, more than log.bookkeeping_soft_timeout={soft_timeout:g} s; a "
              f"slow disk, bucket or network holds the loop.", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the step's speed


class StepClock:
    """Step time measured between consecutive step ends (as OLMo-core's speed monitor, torchtitan and nanoGPT do), so
    a run's step times add up to the loop's wall time: the host's waits for the GPU (at each metrics collection) count
    in the step after them. Evaluation, checkpoint and sample time is measured apart (`aside`), out of the steps."""

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
        """Time a block that is not training: the GPU finishes the step's queued work before the clock starts and the
        block's own work before it stops, so neither spills into the other (two syncs, only around such blocks)."""
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


# ----------------------------------------------------------------------------- collected rows: the writer and the sinks


PARTS_OF_THE_STEP = ("throughput/data_time_sec", "throughput/compile_time_sec")  # in step_time_sec already


class RowWriter:
    """Collected rows, on the main or the bookkeeping thread: flag loss spikes, add the ETA, write the sinks (rank 0)
    and return the console lines of the rows that get one (every log.interval steps, step 0, the last step, a spike, an
    evaluation), printed here with `prints` (async bookkeeping: no loop waits for them). It never raises (it may run on
    the worker thread): the first non-finite loss or grad norm is kept in `nonfinite`, a sentence the loop stops on."""

    def __init__(self, sinks, spikes, log_interval, end_step, prints=False):
        self.sinks, self.spikes, self.end_step, self.prints = sinks, spikes, end_step, prints
        self.writing = threading.Lock()  # rows come from the bookkeeping thread, late values from the loop
        self.last_step, self.logged = 0, {}  # the newest row written, and each metric's latest value
        self.console = Every(log_interval, fixed=(0,))  # a console line every log.interval steps, step 0 and the last
        self.warm = False  # past the first step this process trains
        self.timed_steps, self.timed_seconds = 0, 0.0  # the steps the ETA is measured on, and their time
        self.nonfinite = None

    def __call__(self, rows):
        """Each helper takes the whole batch of rows: a collection calls each once, whatever its number of steps."""
        if not rows:
            return []
        with self.writing:
            self.spikes.flag(rows)
            self.add_eta(rows)
            lines = []
            if self.sinks:
                self.sinks.write(rows)
                lines = [console_line(step, values) for step, values in rows
                         if self.console.due(step, last=step == self.end_step) or "train/loss_spike" in values
                         or "val/loss" in values]
            self.nonfinite = self.nonfinite or first_nonfinite(rows)
            self.last_step = rows[-1][0]
            for _, values in rows:
                self.logged.update(values)
            if self.prints:
                for line in lines:
                    print(line, flush=True)
        return lines

    def late(self, step, values):
        """Values measured after step `step`'s row was written (the time its checkpoint took, uploads that failed
        after the last row): written as a row of that step, which readers merge into it (read_jsonl). Rank 0."""
        if self.sinks:
            with self.writing:
                self.timed_seconds += values.get("throughput/checkpoint_time_sec", 0.0)
                self.sinks.write([(step, dict(values))])
                self.logged.update(values)

    def add_eta(self, rows):
        """throughput/eta_sec: the mean time per step so far (the step and what was set aside in its window:
        evaluations, checkpoints, samples, traces) x the steps left. Measured on the times the rows carry, not on the
        clock: the rows of a collection window arrive together, long after most of their steps ended. The first step
        this process trains is left out: it holds torch.compile and the allocator's warm-up."""
        for step, values in rows:
            if "throughput/step_time_sec" not in values:  # step 0 (evaluations before training), a skipped step
                continue
            if not self.warm:
                self.warm = True
                continue
            self.timed_steps += 1
            self.timed_seconds += sum(value for name, value in values.items() if name.startswith("throughput/")
                                      and name.endswith("_time_sec") and name not in PARTS_OF_THE_STEP)
            values["throughput/eta_sec"] = self.timed_seconds / self.timed_steps * (self.end_step - step)


CONSOLE_LABELS = {  # metric -> its short label in the console line, in this order
    "train/loss": "loss", "val/loss": "val", "eval/hellaswag/acc_norm": "hellaswag acc_norm",
    "eval/average": "tasks average", "train/grad_norm": "norm",  # (each task's primary accuracy: hellaswag_eval.py)
    "optim/lr": "lr", "throughput/tokens_per_sec": "tok/s", "throughput/mfu": "mfu", "throughput/eta_sec": "eta",
    "train/loss_spike": "SPIKE",
}


def console_line(step, values):
    """One compact line with the numbers a person watches; metrics.jsonl has all of them."""
    parts = [f"step {step:>6}"]
    extra_val = {n: n[len("val/"):] for n in sorted(values) if n.startswith("val/") and n != "val/loss"}
    for name, label in {**CONSOLE_LABELS, **extra_val}.items():
        if name in values:
            value = values[name]
            if name == "throughput/eta_sec":
                parts.append(f"eta {int(value) // 3600}:{int(value) % 3600 // 60:02d}:{int(value) % 60:02d}")
            else:
                parts.append(f"{label} {value:,.0f}" if name == "throughput/tokens_per_sec" else f"{label} {value:.4g}")
    return " | ".join(parts)


def read_jsonl(path):
    """The rows of a metrics.jsonl, one per step (a late row of a step, RowWriter.late, is merged into it). A last
    line cut off (a crash or a full disk during an append) is dropped with a warning; any other bad line is an error."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (IsADirectoryError, UnicodeDecodeError) as error:
        raise SinkError(f"{path} is not a metrics.jsonl ({type(error).__name__}); give the train.out_dir of a "
                        f"run.") from None
    merged = {}  # step -> row
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if any(rest.strip() for rest in lines[number:]):
                raise SinkError(f"line {number} of {path} is not JSON; repair or remove that line.") from None
            warnings.warn(f"dropping the cut-off last line of {path} (the run that wrote it was interrupted)")
            continue
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            raise SinkError(f"line {number} of {path} is not a metrics row (a JSON object with a step); give the "
                            f"metrics.jsonl a run wrote.")
        merged.setdefault(row["step"], {}).update(row)
    return list(merged.values())


def truncate_jsonl(path, after_step):
    """On resume from step N, drop rows past N (those steps run again, and must not appear twice) and a
    cut-off last line. Written beside and renamed, so a crash here loses nothing."""
    if not os.path.exists(path):
        return
    kept = "".join(json.dumps(row) + "\n" for row in read_jsonl(path) if row["step"] <= after_step)
    with open(path) as f:
        clean = f.read() == kept  # nothing to drop
    if not clean:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(kept)
        os.replace(tmp, path)


class SinkError(UserError):
    """Rank 0 could not write its metrics (a full disk, say)."""


class Sinks:
    """Where collected metrics go (rank 0 only). A write error does not raise here (it may happen on the bookkeeping
    thread): it is kept in `failed`, and the loop stops at its next step with a checkpoint, then says why."""

    def __init__(self, out_dir, log_cfg, config_dict):
        self.out_dir = out_dir
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self.wandb_run = None
        if log_cfg.wandb:
            from wandb_run import start_wandb
            self.wandb_run = start_wandb(out_dir, log_cfg, config_dict)
        self.failed = None  # the first write error, as a sentence

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.wandb_run is not None:
            self.wandb_run.finish()

    def write(self, rows):
        """[(step, {name: value})] to metrics.jsonl (and a snapshot per evaluation, and W&B)."""
        for _, values in rows:
            for name in values:
                if name in ("tokens", "data/epoch") or name.endswith("/sequences"):
                    values[name] = int(values[name])  # counts, exact in float64
        if self.failed:
            return
        step = rows[0][0]
        try:
            with open(self.jsonl_path, "a") as f:
                for step, values in rows:
                    f.write(json.dumps({"step": step, **values}) + "\n")
                    if any(name.startswith(("val/", "eval/")) for name in values):
                        # OLMo's MetricSaver: one file per evaluation, which the model ladder reads.
                        tmp = os.path.join(self.out_dir, f"metrics_step{step}.json.tmp")
                        with open(tmp, "w") as snapshot:
                            json.dump({"step": step, **values}, snapshot, indent=1)
                        os.replace(tmp, os.path.join(self.out_dir, f"metrics_step{step}.json"))
        except OSError as error:
            self.failed = f"writing metrics in {self.out_dir} failed at step {step} ({error.strerror or error})"
            return
        if self.wandb_run is not None:
            for step, values in rows:
                self.wandb_run.log(values, step=step)
