"""What a run measures: metrics recorded on the device every step, reduced across ranks and written
out in batches; the step's clock; the monitors (loss spikes, non-finite losses, W&B).

`recorder.finish_step(step, {"train/loss": loss, ...}, write)` keeps the tensors on the device, so
recording costs no host-device sync. Every `log.metrics_collect_interval` steps (OLMo-core's) the
pending values of all ranks are reduced in one collective and copied to the host in one transfer;
with `log.async_bookkeeping` (OLMo's), on a background thread over a CPU (gloo) group. `RowWriter`
writes the rows (metrics.jsonl, `metrics_step<N>.json` at evaluations, W&B) and returns their
console lines. Names are namespaced: train/, val/, optim/, throughput/, system/, grad/, data/,
eval/. `python tools/plot_metrics.py RUN_DIR [RUN_DIR ...]` plots them.
"""

import contextlib
import json
import math
import os
import re
import shutil
import sys
import threading
import time
import uuid
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from config import UserError, redact_argv

REDUCTIONS = ("mean", "sum", "max", "l2_norm", None)  # how ranks' values combine; None: rank 0's
COMBINE = {"mean": lambda old, new: (old + new) / 2, "sum": torch.add, "max": torch.maximum,
           "min": torch.minimum}
MERGES = ("warn", "latest", "oldest", *COMBINE)  # a metric recorded twice in a step


class MetricRecorder:
    """Records a step's metrics on the device; `finish_step` collects them every so often and hands
    the rows to `on_rows` (a RowWriter in training), on this thread or, with async bookkeeping, the
    worker's."""

    def __init__(self, device, world_size=1, async_bookkeeping=False, bookkeeping_group=None,
                 on_rows=None, soft_timeout=30.0, copy_event=None):
        self.device, self.world_size, self.on_rows = device, world_size, on_rows
        self.copy_event = copy_event  # the device table's (devices.py); None: the host copy waits
        self.soft_timeout = soft_timeout  # log.bookkeeping_soft_timeout: a longer wait warns
        self.step_values = {}  # name -> the (merged) value recorded in the current step
        self.reductions = {}  # name -> how ranks combine it; fixed by the first record
        self.pending = []  # (step, {name: value}) not yet collected
        self.group = bookkeeping_group  # async bookkeeping's own gloo group
        self.worker = ThreadPoolExecutor(max_workers=1) if async_bookkeeping else None
        self.in_flight = None
        self.nonfinite = ""  # the first non-finite loss or gradient norm collected, in words

    def record_metric(self, name, value, reduce="mean", merge="warn"):
        """Record `value` (a tensor or number) for this step. `reduce` says how ranks combine: mean,
        sum, max, l2_norm (sqrt of the sum of squares: for norms computed per rank) or None (rank
        0's value). A metric recorded twice in a step is merged as OLMo-core does: warn (keep the
        first, with a warning), latest, oldest, mean (of the two), sum, max, min. Merging is tensor
        arithmetic: no host sync."""
        self.record_all({name: value}, reduce, merge)

    def record_all(self, values, reduce="mean", merge="warn"):
        """record_metric for each of {name: value}, in one call."""
        assert reduce in REDUCTIONS and merge in MERGES, (reduce, merge)
        for name, value in values.items():
            if self.reductions.setdefault(name, reduce) != reduce:
                raise ValueError(f"metric {name} was recorded with "
                                 f"reduce={self.reductions[name]!r} and now with "
                                 f"reduce={reduce!r}; a metric must keep one reduce type.")
            value = value.detach() if torch.is_tensor(value) else value
            if name not in self.step_values or merge == "latest":
                self.step_values[name] = value
            elif merge == "warn":
                warnings.warn(f"metric {name} recorded twice in one step; keeping the first value")
            elif merge != "oldest":
                old, new = (torch.as_tensor(v, dtype=torch.float64, device=self.device)
                            for v in (self.step_values[name], value))
                self.step_values[name] = COMBINE[merge](old, new)

    def get(self, name):
        """This step's value of `name` as it will be logged (merged, then reduced over the ranks:
        OLMo-core's get_metric), a float, or None if not recorded this step. One collective and one
        host sync: ask only when needed, on every rank alike."""
        if name not in self.step_values:
            return None
        value = torch.as_tensor(self.step_values[name], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            value = self.reduce(value.reshape(1), [self.reductions[name]], group=None)
        return value.item()

    def finish_step(self, step, values=None, write=False, wait=False, maxima=None):
        """Record the step's `values` (their means over the ranks) and `maxima` (the largest rank's:
        times every rank waited for, memory), as record_all would, and end `step`; with `write`,
        reduce every pending step over the ranks and hand the rows to `on_rows`; with `wait` too,
        return once they are handled (metrics.jsonl then holds every step so far). Returns (the
        console lines `on_rows` returned here, or [] (none written, or async); the first non-finite
        loss or gradient norm found in the rows handed over so far, in words, or "")."""
        for reduce, recorded in (("mean", values or {}), ("max", maxima or {})):
            for name, value in recorded.items():  # (a name recorded already keeps its first value)
                if self.reductions.setdefault(name, reduce) != reduce:
                    raise ValueError(f"metric {name} was recorded with reduce="
                                     f"{self.reductions[name]!r} and now with reduce={reduce!r}; a "
                                     f"metric must keep one reduce type.")
                value = value.detach() if torch.is_tensor(value) else value
                self.step_values.setdefault(name, value)
        if self.step_values:
            self.pending.append((step, self.step_values))
        self.step_values = {}
        if self.nonfinite:  # (found on the worker since): every row is written before the run ends
            write = wait = True
        if not write:
            return [], self.nonfinite
        start = time.perf_counter()
        lines = []
        if self.worker is None:
            lines = self.hand_over(self.collect())
        else:
            self.collect(self.hand_over)
            if wait:
                self.wait()
        seconds = time.perf_counter() - start
        if seconds > self.soft_timeout:
            warn_slow(f"collecting the metrics of step {step}", seconds, self.soft_timeout)
        return lines, self.nonfinite

    def hand_over(self, rows):
        """Hand collected `rows` to on_rows (on the worker thread with async bookkeeping), noting
        the first non-finite loss or gradient norm among them."""
        self.nonfinite = self.nonfinite or first_nonfinite(rows)
        return self.on_rows(rows)

    def collect(self, handle_rows=None):
        """Reduce every pending metric over the ranks: one collective, one copy to the host. Returns
        [(step, {name: float})] in step order; every rank calls it together. With `handle_rows`
        (async bookkeeping) the reduction and handle_rows(rows) run on the worker thread instead,
        and the error of the batch before is raised here."""
        if self.in_flight is not None:
            self.wait()
        entries = [(step, name, value) for step, step_values in self.pending
                   for name, value in sorted(step_values.items())]
        self.pending = []
        if not entries:
            return []
        values = one_vector([value for _, _, value in entries], self.device)
        kinds = [self.reductions[name] for _, name, _ in entries]
        labels = [(step, name) for step, name, _ in entries]
        if handle_rows is None:
            if self.world_size > 1:  # (one rank has nothing to combine)
                values = self.reduce(values, kinds, group=None)
            return rows_of(labels, values)
        # With an event the copy overlaps with the next steps; without one it waits here.
        host_values = values.to("cpu", non_blocking=self.copy_event is not None)
        copied = self.copy_event() if self.copy_event is not None else None
        if copied is not None:
            copied.record()

        def finish():
            if copied is not None:
                copied.synchronize()
            reduced = host_values
            if self.world_size > 1:
                reduced = self.reduce(host_values, kinds, self.group)
            handle_rows(rows_of(labels, reduced))

        self.in_flight = self.worker.submit(finish)
        return []

    def wait(self):
        """Wait for async bookkeeping in flight (before a checkpoint, at the end); raise its error.
        """
        if self.in_flight is not None:
            in_flight, self.in_flight = self.in_flight, None
            in_flight.result()

    def close(self):
        if self.worker is not None:
            self.worker.shutdown(wait=True)

    def reduce(self, values, kinds, group):
        """Combine every rank's vector with one all-gather, each entry by its own reduction."""
        device = values.device
        squared = torch.tensor([k == "l2_norm" for k in kinds], device=device)
        values = torch.where(squared, values * values, values)
        gathered = torch.empty(self.world_size * len(values), dtype=values.dtype, device=device)
        # all_gather_single is torch 2.13's name for all_gather_into_tensor, which now warns
        all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        all_gather(gathered, values, group=group)
        gathered = gathered.view(self.world_size, -1)
        is_max = torch.tensor([k == "max" for k in kinds], device=device)
        is_mean = torch.tensor([k == "mean" for k in kinds], device=device)
        is_rank0 = torch.tensor([k is None for k in kinds], device=device)
        summed = gathered.sum(0)
        values = torch.where(is_max, gathered.max(0).values,
                             torch.where(is_mean, summed / self.world_size, summed))
        values = torch.where(is_rank0, gathered[0], values)
        return torch.where(squared, values.clamp_min(0).sqrt(), values)


def first_nonfinite(rows):
    """The first non-finite train/loss or train/grad_norm in host `rows`, in words, or ""."""
    for step, values in rows:
        bad = [name for name in ("train/loss", "train/grad_norm")
               if not math.isfinite(values.get(name, 0.0))]
        if bad:
            return (f"{bad[0]} is {values[bad[0]]} at step {step}, so no checkpoint was saved "
                    f"after it")
    return ""


def one_vector(values, device):
    """`values` (tensors and numbers) as one float64 vector on `device`: float64 keeps large counts
    (tokens, FLOPs) exact. Device tensors stack in place; host numbers go in one copy."""
    vector = torch.empty(len(values), dtype=torch.float64, device=device)
    on_device = [i for i, value in enumerate(values) if torch.is_tensor(value)]
    on_host = [i for i, value in enumerate(values) if not torch.is_tensor(value)]
    if on_device:
        vector[on_device] = torch.stack([values[i].to(device, torch.float64).reshape(())
                                         for i in on_device])
    if on_host:
        vector[on_host] = torch.tensor([float(values[i]) for i in on_host],
                                       dtype=torch.float64).to(device)
    return vector


def rows_of(labels, values):
    """[(step, {name: float})] in step order, of [(step, name)] `labels` and their `values`."""
    rows = {}
    for (step, name), value in zip(labels, values.tolist()):
        rows.setdefault(step, {})[name] = value
    return sorted(rows.items())


def warn_slow(what, seconds, soft_timeout):
    """log.bookkeeping_soft_timeout (OLMo-core's): bookkeeping that held the loop this long."""
    print(f"warning: {what} took {seconds:.3g} s, more than log.bookkeeping_soft_timeout="
          f"{soft_timeout:g} s; a slow disk, bucket or network holds the loop.", file=sys.stderr,
          flush=True)


# ----------------------------------------------------------------------- the step's clock and speed


def mfu(flops_per_token, tokens_per_sec, world_size, peak_flops):
    """Model FLOPs utilisation (PaLM, appendix B): the model's training FLOP/s per device as a
    share of one device's peak."""
    return flops_per_token * tokens_per_sec / world_size / peak_flops


class StepClock:
    """Step time measured between consecutive step ends (as OLMo-core's speed monitor, torchtitan
    and nanoGPT do), so a run's step times add up to the loop's wall time: the host's waits for the
    GPU (at each metrics collection) count in the step after them. Evaluations, checkpoints and
    samples are timed apart (`paused`), out of the steps."""

    def __init__(self, synchronize, tokens_per_step, block_size, flops_per_token, world_size,
                 peak_flops):
        # the device table's (devices.py): waits for the device's queued work (a no-op on a CPU)
        self.synchronize = synchronize
        self.tokens_per_step, self.block_size = tokens_per_step, block_size
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.peak_flops = peak_flops
        self.last_end = time.perf_counter()
        self.apart = {}  # throughput/<kind>_time_sec -> seconds paused since the last step ended
        self.unlogged = 0.0  # seconds paused whose time is logged elsewhere (a checkpoint's)

    def lap(self, tokens_seen, data_time, trained=True):
        """At the end of a step: ({throughput metric: value} of the step, or {} for a step that
        trained nothing; {throughput/<kind>_time_sec: seconds} paused in its window)."""
        now = time.perf_counter()
        apart, self.apart = self.apart, {}
        paused, self.unlogged = sum(apart.values()) + self.unlogged, 0.0
        step_time, self.last_end = now - self.last_end - paused, now
        if not trained:
            return {}, apart
        tokens_per_sec = self.tokens_per_step / step_time
        speed = {"throughput/tokens_per_sec": tokens_per_sec,
                 "throughput/sequences_per_sec": tokens_per_sec / self.block_size,
                 "throughput/step_time_sec": step_time, "throughput/data_time_sec": data_time,
                 # OLMo's global_train_petaflops: the training compute spent so far, all ranks
                 "throughput/total_petaflops": self.flops_per_token * tokens_seen / 1e15}
        if self.peak_flops:  # (unknown on CPUs: no MFU rather than a made-up one)
            speed["throughput/mfu"] = mfu(self.flops_per_token, tokens_per_sec, self.world_size,
                                          self.peak_flops)
        return speed, apart

    @contextlib.contextmanager
    def paused(self, kind, logged=True):
        """Time a block that is not training, out of the next step's time and, if `logged`, into
        its throughput/<kind>_time_sec. The GPU finishes the step's queued work before the clock
        stops and the block's own work before it restarts, so neither spills into the other (two
        syncs, only around such blocks)."""
        self.synchronize()
        start = time.perf_counter()
        yield
        self.synchronize()
        seconds, name = time.perf_counter() - start, f"throughput/{kind}_time_sec"
        if logged:
            self.apart[name] = self.apart.get(name, 0.0) + seconds
        else:
            self.unlogged += seconds


# ----------------------------------------------------------------------------------- the monitors


class LossSpikeDetector:
    """Flags a logged loss that exceeds the mean of the previous `window` finite losses by
    `threshold` nats, once there are 10 of them (train.loss_spike_threshold)."""

    def __init__(self, threshold, window=50):
        self.threshold, self.recent = threshold, deque(maxlen=window)

    def flag(self, rows):
        """Mark train/loss_spike in each host row [(step, {name: value})] whose loss is a spike."""
        for _, values in rows:
            loss = values.get("train/loss")
            if loss is None:
                continue
            if (self.threshold > 0 and len(self.recent) >= 10
                    and loss > sum(self.recent) / len(self.recent) + self.threshold):
                values["train/loss_spike"] = 1.0
            if math.isfinite(loss):
                self.recent.append(loss)


class NonFiniteLoss(UserError):
    """Training produced NaN or Inf; the message says what to do."""


# ------------------------------------------------------------------------------- writing the rows

# In throughput/step_time_sec already: not added again to the time a step window took (the ETA)
PARTS_OF_THE_STEP = ("throughput/data_time_sec", "throughput/compile_time_sec")
CONSOLE_LABELS = {  # metric -> its short label in the console line, in this order
    "train/loss": "loss", "val/loss": "val", "eval/hellaswag/acc_norm": "hellaswag acc_norm",
    "eval/average": "tasks average", "train/grad_norm": "norm", "optim/lr": "lr",
    "throughput/tokens_per_sec": "tok/s", "throughput/mfu": "mfu", "throughput/eta_sec": "eta",
    "train/loss_spike": "SPIKE",
}


def console_line(step, values):
    """The numbers a person watches, of row `values`: "step 100 | loss 5.12 | ... | eta 0:03:10"."""
    parts = [f"step {step:>6}"]
    val = {n: n[4:] for n in sorted(values) if n.startswith("val/") and n != "val/loss"}
    for name, label in {**CONSOLE_LABELS, **val}.items():
        value = values.get(name)
        if value is None:
            continue
        if name == "throughput/tokens_per_sec":
            text = f"{value:,.0f}"
        elif name == "throughput/eta_sec":
            seconds = int(value)
            text = f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
        else:
            text = f"{value:.4g}"
        parts.append(f"{label} {text}")
    return " | ".join(parts)


class Eta:
    """throughput/eta_sec: the mean time per step so far (the step and what was timed apart in its
    window: evaluations, checkpoints, samples) x the steps left. The first step this process trains
    holds torch.compile and the allocator's warm-up: left out."""

    def __init__(self, end_step):
        self.end_step = end_step
        self.warm = False  # past the first step this process trains
        self.steps, self.seconds = 0, 0.0  # the steps the ETA is measured on, and their time

    def update(self, step, values):
        """Count in row `values` of `step`; returns the seconds left, or None before a step is
        timed."""
        if self.warm or "throughput/checkpoint_time_sec" in values:
            self.seconds += sum(value for name, value in values.items()
                                if name.startswith("throughput/") and name.endswith("_time_sec")
                                and name not in PARTS_OF_THE_STEP)
        eta = None
        if "throughput/step_time_sec" in values and self.warm:
            self.steps += 1
            eta = self.seconds / self.steps * (self.end_step - step)
        self.warm = self.warm or "throughput/step_time_sec" in values
        return eta


class SinkError(UserError):
    """Rank 0 could not write its metrics (a full disk, say)."""


class RowWriter:
    """Rows of collected metrics, from the main or the bookkeeping thread (the recorder calls it):
    flags loss spikes, adds the ETA, writes them (rank 0: metrics.jsonl, a metrics_step<N>.json per
    evaluation, W&B) and returns the console lines of those that get one (every log.interval steps,
    the last step, a spike, an evaluation), printed here with `prints` (async bookkeeping: no loop
    waits for them). It never raises (it may run on the worker thread): a write error is kept in
    `failed`, on which the loop saves and stops. A row for a step already written (a checkpoint's
    time, uploads that failed late) is written as any other, and readers merge it in (read_jsonl).
    A context manager: W&B's run (`wandb_run`, started by start_wandb) finishes when it closes.
    `out_dir` None: a rank other than 0, which writes nothing. `console`: the plan's Every of
    log.interval."""

    def __init__(self, out_dir, end_step, console, spike_threshold=0.0, prints=False,
                 wandb_run=None):
        self.out_dir, self.end_step, self.prints = out_dir, end_step, prints
        self.console = console  # (plan.Every)
        self.spikes = LossSpikeDetector(spike_threshold)
        self.eta = Eta(end_step)
        self.writing = threading.Lock()  # rows come from the bookkeeping thread and the loop
        self.last_step, self.logged = 0, {}  # the newest row written, and each metric's latest
        self.failed = None  # a sentence
        self.wandb_run = wandb_run
        if wandb_run is not None:  # the folder is this run's now: a restart logs into the same run
            with open(os.path.join(out_dir, "wandb_id.txt"), "w") as f:
                f.write(wandb_run.id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.wandb_run is not None:
            self.wandb_run.finish()

    def write(self, rows):
        """[(step, {name: value})]: flags spikes, adds the ETA, writes the rows and returns their
        console lines."""
        if not rows:
            return []
        with self.writing:
            self.spikes.flag(rows)
            lines = []
            for step, values in rows:
                eta = self.eta.update(step, values)
                if eta is not None:
                    values["throughput/eta_sec"] = eta
                if self.out_dir and self.gets_a_line(step, values):
                    lines.append(console_line(step, values))
                for name in values:
                    if name in ("tokens", "data/epoch") or name.endswith("/sequences"):
                        values[name] = int(values[name])  # counts, exact in float64
                self.logged.update(values)
            self.last_step = max(self.last_step, rows[-1][0])
            if self.out_dir and not self.failed:
                self.append(rows)
            if self.prints:
                for line in lines:
                    print(line, flush=True)
        return lines

    def gets_a_line(self, step, values):
        """A console line for an evaluation, and for a loss at log.interval, the last step or a
        spike."""
        due = (self.console.due(step, last=step == self.end_step)
               or "train/loss_spike" in values)
        return "val/loss" in values or ("train/loss" in values and due)

    def append(self, rows):
        """Rows to metrics.jsonl, a metrics_step<N>.json per evaluation, and W&B; a write error is
        kept in `failed`."""
        try:
            with open(os.path.join(self.out_dir, "metrics.jsonl"), "a") as f:
                for step, values in rows:
                    f.write(json.dumps({"step": step, **values}) + "\n")
                    if any(name.startswith(("val/", "eval/")) for name in values):
                        # OLMo's MetricSaver: a file per evaluation, which the ladder reads
                        path = os.path.join(self.out_dir, f"metrics_step{step}.json")
                        with open(f"{path}.tmp", "w") as snapshot:
                            json.dump({"step": step, **values}, snapshot, indent=1)
                        os.replace(f"{path}.tmp", path)
        except OSError as error:
            self.failed = (f"writing metrics in {self.out_dir} failed at step {step} "
                           f"({error.strerror or error})")
        if self.wandb_run is not None and not self.failed:
            for step, values in rows:
                self.wandb_run.log(values, step=step)

    __call__ = write  # (the recorder hands it the rows it collects)


def start_wandb(out_dir, log_cfg, config_dict, resumed):
    """Start or resume this run's W&B run (log.wandb), before the run folder changes. A resumed
    run's id is in <out_dir>/wandb_id.txt (RowWriter writes it), so a restart logs into the same
    run; WANDB_MODE=offline writes it under <out_dir>/wandb/ for a later sync. A W&B that cannot
    start the run (a server out of reach, a bad key) is one sentence, and the wandb/ folder goes
    when this start made it."""
    import wandb

    id_path, folder = os.path.join(out_dir, "wandb_id.txt"), os.path.join(out_dir, "wandb")
    run_id = uuid.uuid4().hex[:8]  # W&B run ids are short lowercase strings
    if resumed and os.path.exists(id_path):  # (a fresh start replaces the old run's id)
        with open(id_path) as f:
            run_id = f.read().strip()
    made = not os.path.exists(folder)
    # W&B records the command line (sys.argv): it reads one whose secrets are "***", as
    # `config_dict` holds them.
    argv, sys.argv = sys.argv, redact_argv(sys.argv)
    try:
        return wandb.init(project=log_cfg.wandb_project,
                          name=log_cfg.wandb_name or os.path.basename(os.path.abspath(out_dir)),
                          group=log_cfg.wandb_group or None, tags=log_cfg.wandb_tags or None,
                          id=run_id, resume="allow", dir=out_dir, config=config_dict)
    except Exception as error:  # noqa: BLE001 - the network, the key, the server: any of W&B's
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        why = (str(error).strip().splitlines() or [""])[0][:200]
        raise UserError(f"W&B could not start the run ({type(error).__name__}: {why}); check the "
                        f"network and your key (`wandb login`), or log offline with "
                        f"WANDB_MODE=offline (`wandb sync` later), or set --log.wandb=false."
                        ) from None
    finally:
        sys.argv = argv


class WandbCancel:
    """Rank 0 asks W&B's API whether the run carries one of log.wandb_cancel_tags (OLMo's
    cancel_tags), so that tagging a run `cancel` in W&B's web page stops it as a CANCEL file does.
    The Stopper calls `ask` at each of its checks and reads `tag`; the question goes out on a
    thread of its own, one at a time and at most one every `every` seconds
    (log.wandb_cancel_seconds), so the loop never waits for W&B. W&B offline or unreachable: one
    warning, and the run goes on. A context manager: the thread ends with the run."""

    def __init__(self, wandb_run, tags, every=30.0):
        self.path, self.tags = wandb_run.path, tuple(tags)  # path: entity/project/run id
        self.every = every
        self.tag = ""  # the first cancel tag found on the run; "" until then
        self.wanted, self.ended = threading.Event(), threading.Event()
        self.thread = None
        if getattr(wandb_run, "offline", False) or os.environ.get("WANDB_MODE") in (
                "offline", "disabled", "dryrun"):
            self.warn("W&B is offline")
        else:
            self.thread = threading.Thread(target=self.watch, name="wandb-cancel", daemon=True)
            self.thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.ended.set()
        self.wanted.set()

    def ask(self):
        """Ask W&B again, unless a question is out already."""
        self.wanted.set()

    def warn(self, why):
        print(f"warning: {why}, so a tag in W&B ({', '.join(self.tags)}) cannot cancel this run; "
              "it goes on (a CANCEL file in the run folder still stops it).", file=sys.stderr,
              flush=True)

    def watch(self):
        import wandb

        while not self.tag:
            self.wanted.wait()
            self.wanted.clear()
            if self.ended.is_set():
                return
            asked = time.monotonic()
            try:  # a fresh Api each time: it caches the runs it has read
                tags = wandb.Api().run(self.path).tags
            except Exception as error:  # noqa: BLE001 - the network, the key, the server: any
                self.warn(f"W&B's API did not answer ({type(error).__name__}: {error})")
                return
            self.tag = next((t for t in self.tags if t in tags), "")
            self.ended.wait(max(0.0, self.every - (time.monotonic() - asked)))  # (or the run ends)

    def untag(self):
        """Take the tag off the run once it has stopped it (left there, it would cancel the resumed
        run at once); True if done."""
        import wandb

        try:
            run = wandb.Api().run(self.path)
            run.tags = [t for t in run.tags if t != self.tag]
            run.update()
            return True
        except Exception:  # noqa: BLE001 - as in watch
            return False


# -------------------------------------------------------------------------- reading the rows back


def read_jsonl(path):
    """The rows of a metrics.jsonl, one per step (a row added to a step later is merged into it). A
    last line cut off (a crash or a full disk during an append) is dropped with a warning; any other
    bad line is an error."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (IsADirectoryError, UnicodeDecodeError) as error:
        raise SinkError(f"{path} is not a metrics.jsonl ({type(error).__name__}); give the "
                        f"train.out_dir of a run.") from None
    merged = {}  # step -> row
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if any(rest.strip() for rest in lines[number:]):
                raise SinkError(f"line {number} of {path} is not JSON; repair or remove that "
                                f"line.") from None
            warnings.warn(f"dropping the cut-off last line of {path} (its run was interrupted)")
            continue
        if not (isinstance(row, dict) and isinstance(row.get("step"), int)):
            raise SinkError(f"line {number} of {path} is not a metrics row (a JSON object with a "
                            f"step); give the metrics.jsonl a run wrote.")
        merged.setdefault(row["step"], {}).update(row)
    return list(merged.values())


def metrics_snapshots(out_dir, from_step=0):
    """{step: path} of the `metrics_step<N>.json` files in `out_dir` with N >= `from_step`."""
    found = {}
    for name in os.listdir(out_dir):
        match = re.fullmatch(r"metrics_step(\d+)\.json", name)
        if match and int(match.group(1)) >= from_step:
            found[int(match.group(1))] = os.path.join(out_dir, name)
    return found


def truncate_jsonl(path, after_step):
    """On resume from step N, drop rows past N (those steps run again, and must not appear twice)
    and a cut-off last line. Written beside and renamed, so a crash here loses nothing."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:  # nothing to drop: the file stays as it is, byte for byte
        if text.endswith("\n") and all(json.loads(line)["step"] <= after_step
                                        for line in text.splitlines() if line.strip()):
            return
    except (ValueError, KeyError, TypeError):  # a damaged line: read_jsonl says what it is
        pass
    kept = "".join(json.dumps(row) + "\n" for row in read_jsonl(path) if row["step"] <= after_step)
    if text != kept:
        with open(f"{path}.tmp", "w") as f:
            f.write(kept)
        os.replace(f"{path}.tmp", path)
