"""recorder.get(name): a fork's or callback's read of this step's metric, as it will be logged (merged, then reduced
over the ranks by its reduce type; one process here: the reduction over ranks is the same `_reduce` the logged rows
go through, tested on 2 ranks by the loop's metrics tests)."""

import torch

from metrics import MetricRecorder


def test_get_returns_this_steps_value_as_it_will_be_logged():
    recorder = MetricRecorder("cpu")
    logged = []
    recorder.on_rows = lambda rows: logged.extend(rows) or []
    assert recorder.get("train/loss") is None  # not recorded this step
    recorder.record_metric("train/loss", torch.tensor(2.0))
    recorder.record_metric("train/loss", torch.tensor(4.0), merge="mean")
    recorder.record_metric("tokens", 1024, reduce="sum")
    assert recorder.get("train/loss") == 3.0 and recorder.get("tokens") == 1024.0
    recorder.finish_step(1, write=True)
    assert logged == [(1, {"tokens": 1024.0, "train/loss": 3.0})]  # what get said is what was logged
    assert recorder.get("train/loss") is None  # a new step

