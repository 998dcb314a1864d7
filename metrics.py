"""Metrics: recorded on the device every step, reduced across ranks and written out in batches.

The loop calls `recorder.record_metric("train/loss", loss)` with tensors that stay on the device, so
recording costs no host-device sync. Every `log.metrics_collect_interval` steps `collect()` reduces
all pending values of all ranks in one collective and copies them to the host in one transfer (as
OLMo-core's metrics_collect_interval); the loop then hands the rows to the sinks below.
"""

import json
import math
import os
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist

REDUCTIONS = ("mean", "sum", "max", "l2_norm")  # how ranks' values combine
MERGES = ("warn", "latest", "oldest", "mean", "sum", "max", "min")  # a metric recorded twice in a step


class MetricRecorder:
    def __init__(self, device, world_size=1):
        self.device, self.world_size = device, world_size
        self.step_values = defaultdict(list)  # name -> values recorded in the current step
        self.rules = {}  # name -> (reduce, merge)
        self.pending = []  # (step, {name: [values]}) not yet collected
        self.warned = set()

    def record_metric(self, name, value, reduce="mean", merge="warn"):
        """Record `value` (a tensor or number) for this step. `reduce` says how ranks combine: mean,
        sum, max, or l2_norm (sqrt of the sum of squares: for norms computed per rank)."""
        assert reduce in REDUCTIONS and merge in MERGES, (reduce, merge)
        if self.step_values[name] and merge == "warn" and name not in self.warned:
            warnings.warn(f"metric {name} recorded twice in one step; keeping the latest value")
            self.warned.add(name)
        self.rules[name] = (reduce, merge)
        value = value.detach() if torch.is_tensor(value) else value
        self.step_values[name].append(value)

    def end_step(self, step):
        if self.step_values:
            self.pending.append((step, dict(self.step_values)))
        self.step_values = defaultdict(list)

    def collect(self):
        """Reduce every pending metric over ranks: one collective, one copy to the host.
        Returns [(step, {name: float}), ...] in step order. Every rank must call it together."""
        entries = [(step, name, self._merge(name, values))
                   for step, metrics in self.pending for name, values in sorted(metrics.items())]
        self.pending = []
        if not entries:
            return []
        values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device).reshape(())
                              for _, _, v in entries])
        kinds = [self.rules[name][0] for _, name, _ in entries]
        squared = torch.tensor([k == "l2_norm" for k in kinds], device=self.device)
        values = torch.where(squared, values * values, values)
        if self.world_size > 1:
            gathered = torch.empty(self.world_size * len(values), device=self.device)
            dist.all_gather_into_tensor(gathered, values)
            gathered = gathered.view(self.world_size, -1)
            is_max = torch.tensor([k == "max" for k in kinds], device=self.device)
            is_mean = torch.tensor([k == "mean" for k in kinds], device=self.device)
            summed = gathered.sum(0)
            values = torch.where(is_max, gathered.max(0).values,
                                 torch.where(is_mean, summed / self.world_size, summed))
        values = torch.where(squared, values.clamp_min(0).sqrt(), values)
        rows = {}
        for (step, name, _), value in zip(entries, values.tolist()):
            rows.setdefault(step, {})[name] = value
        return sorted(rows.items())

    def _merge(self, name, values):
        merge = self.rules[name][1]
        if len(values) == 1 or merge in ("warn", "latest"):
            return values[-1]
        if merge == "oldest":
            return values[0]
        stacked = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device) for v in values])
        return {"mean": stacked.mean, "sum": stacked.sum, "max": stacked.max, "min": stacked.min}[merge]()


# ----------------------------------------------------------------------------- sinks


def console_line(step, values):
    """One compact line: the headline numbers first, then everything else alphabetically."""
    parts = [f"step {step:>6}"]
    for name in sorted(values, key=lambda n: (not n.startswith(("train/", "val/")), n)):
        value = values[name]
        text = f"{value:.4g}" if isinstance(value, float) and not math.isnan(value) else str(value)
        parts.append(f"{name} {text}")
    return " | ".join(parts)


def append_jsonl(path, step, values):
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, **values}) + "\n")


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_jsonl(path, after_step):
    """On resume from step N, drop rows past N: those steps run again, and must not appear twice."""
    rows = read_jsonl(path)
    kept = [row for row in rows if row["step"] <= after_step]
    if len(kept) != len(rows):
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        os.replace(tmp, path)
