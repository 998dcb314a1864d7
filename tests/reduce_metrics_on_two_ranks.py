"""Run by test_metrics.py under torchrun: each rank records rank-dependent values, rank 0 writes the result."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from metrics import MetricRecorder  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
recorder = MetricRecorder("cpu", dist.get_world_size())
value = torch.tensor(float(rank + 1))  # rank 0 records 1, rank 1 records 2
for reduce in ("mean", "sum", "max", "l2_norm"):
    recorder.record_metric(f"test/{reduce}", value, reduce=reduce)
recorder.record_metric("test/rank0", value, reduce=None)  # no reduction: rank 0's value
recorder.finish_step(1, write=False)
recorder.record_metric("test/mean", 10.0 * (rank + 1))  # a second step, a plain number
recorder.finish_step(2, write=False)
rows = recorder.collect()
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(rows))
dist.destroy_process_group()
