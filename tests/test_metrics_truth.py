"""The metrics say what is true: the ETA follows the steps' own times, the peak memory is never below the
current, and `tools/plot_metrics.py` refuses a file for a folder and keeps runs whose folders share a name apart."""

import json
import time
import types

import pytest
import torch
from conftest import run_in_process

import devices
import metrics
import plan
from tools import plot_metrics


def eta_rows(step_times, collect_interval, async_bookkeeping):
    """Hand `step_times` (step 1 first) to a RowWriter as the loop does: recorded every step, collected
    every `collect_interval` steps (the rows of a window arrive together), on the worker thread with async
    bookkeeping. Returns {step: the row as written}."""
    end_step = len(step_times)
    writer = metrics.RowWriter(None, end_step, plan.Every(1))
    written = {}

    def on_rows(rows):
        writer(rows)
        written.update(rows)

    recorder = metrics.MetricRecorder("cpu", async_bookkeeping=async_bookkeeping, on_rows=on_rows)
    for step, step_time in enumerate(step_times, 1):
        recorder.record_all({"throughput/step_time_sec": step_time, "train/loss": 3.0})
        recorder.finish_step(step, write=step % collect_interval == 0 or step == end_step)
    recorder.wait()
    recorder.close()
    return written


def remaining(step_times, step):
    return sum(step_times[step:])  # the time the steps after `step` take


@pytest.mark.parametrize("async_bookkeeping", [False, True], ids=["sync", "async"])
def test_eta_of_rows_collected_together_is_the_time_their_steps_leave(async_bookkeeping):
    # 20 steps of 0.5 s, collected 5 at a time: the rows of a window reach the writer at one moment (here
    # right away), and each row's ETA must still be the time left after its own step.
    step_times = [0.5] * 20
    rows = eta_rows(step_times, collect_interval=5, async_bookkeeping=async_bookkeeping)
    for step in range(2, 21):
        assert rows[step]["throughput/eta_sec"] == pytest.approx(remaining(step_times, step), rel=0.1, abs=1e-9), step


def test_eta_is_not_dominated_by_the_compiling_first_step(monkeypatch):
    # The first step waits 30 s for torch.compile, the others take 0.1 s; rows arrive one at a time, each
    # when its step ends (the clock follows the steps), as with metrics_collect_interval=1.
    step_times = [30.0] + [0.1] * 19
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    writer = metrics.RowWriter(None, len(step_times), plan.Every(1))
    for step, step_time in enumerate(step_times, 1):
        clock[0] += step_time
        values = {"throughput/step_time_sec": step_time}
        if step == 1:
            values["throughput/compile_time_sec"] = step_time
        writer([(step, values)])
        if step > 1:
            assert values["throughput/eta_sec"] == pytest.approx(remaining(step_times, step), rel=0.1, abs=1e-9), step


def test_cpu_peak_memory_is_never_below_the_current(monkeypatch):
    # ru_maxrss is the kernel's high-water mark, updated lazily: it can read below /proc/self/statm's
    # current resident set a moment after memory grew. Here it lags as far as it can.
    big = torch.ones(2**25)  # 128 MiB resident now
    monkeypatch.setattr(devices.resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=1))
    values = devices.cpu_memory("cpu")
    assert values["system/cpu_rss_gb"] > 0.1 and big.sum() > 0
    assert values["system/cpu_rss_peak_gb"] >= values["system/cpu_rss_gb"]
    monkeypatch.undo()
    values = devices.cpu_memory("cpu")  # the real high-water mark, in the same unit (GiB)
    assert values["system/cpu_rss_gb"] <= values["system/cpu_rss_peak_gb"] < 100 * values["system/cpu_rss_gb"]


def test_cpu_peak_memory_reads_macos_bytes_as_bytes(monkeypatch):
    # getrusage gives ru_maxrss in KiB on Linux but in bytes on macOS.
    monkeypatch.setattr(devices.sys, "platform", "darwin")
    monkeypatch.setattr(devices.resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=3 * 2**30))
    assert devices.cpu_memory("cpu")["system/cpu_rss_peak_gb"] == pytest.approx(3.0)


def write_run(run_dir, losses):
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "tokens": 128 * step, "train/loss": loss}) + "\n")


def test_plot_refuses_an_existing_file_as_out_in_one_sentence(tmp_path):
    write_run(tmp_path / "run", [4.0, 3.0])
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    result = run_in_process([str(tmp_path / "run"), f"--out={taken}"], plot_metrics.main)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and result.stderr.startswith("error: ") and str(taken) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert taken.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "run"]


def test_run_labels_are_the_shortest_path_tails_that_tell_runs_apart():
    assert plot_metrics.run_labels(["a/x/run", "b/x/run", "c/y/run", "solo"]) == ["a/x/run", "b/x/run", "y/run", "solo"]
    assert plot_metrics.run_labels(["ladders/adamw/2x32", "ladders/muon/2x32/"]) == ["adamw/2x32", "muon/2x32"]
    assert plot_metrics.run_labels(["runs/one"]) == ["one"]


def test_plot_draws_every_run_when_folders_share_a_name(tmp_path, monkeypatch):
    import matplotlib.figure

    write_run(tmp_path / "ladders" / "adamw" / "2x32", [4.0, 3.0, 2.5])
    write_run(tmp_path / "ladders" / "muon" / "2x32", [4.0, 2.8, 2.2])
    drawn = {}  # PNG name -> {legend label: y values}
    savefig = matplotlib.figure.Figure.savefig

    def spy(fig, path, **kwargs):
        lines = fig.axes[0].get_lines()
        drawn[path.rsplit("/", 1)[-1]] = {line.get_label(): list(line.get_ydata()) for line in lines}
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    result = run_in_process([str(tmp_path / "ladders" / "adamw" / "2x32"), str(tmp_path / "ladders" / "muon" / "2x32"),
                             f"--out={tmp_path / 'plots'}"], plot_metrics.main)
    assert result.returncode == 0, result.stderr
    assert drawn["loss_vs_step.png"] == {"adamw/2x32 train/loss": [4.0, 3.0, 2.5],
                                         "muon/2x32 train/loss": [4.0, 2.8, 2.2]}
    assert drawn["loss_vs_tokens.png"] == drawn["loss_vs_step.png"]
    assert (tmp_path / "plots" / "loss_vs_step.png").stat().st_size > 0
