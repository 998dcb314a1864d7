"""tools/bench.py, the per-step figure docs/measurements.md reports, runs and prints what it says; its
time-to-loss mode finds the first evaluation at or below the target and reports it by run."""

import importlib.util
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

spec = importlib.util.spec_from_file_location("bench", os.path.join(ROOT, "tools", "bench.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_bench_py_reports_the_median_step_time(data_root):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--steps=13",
                             f"--data_root={data_root}"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    median = re.search(r"ours\s+([\d.]+)\s+-> median ([\d.]+) ms", result.stdout)
    assert median and float(median.group(1)) == float(median.group(2)) > 0


def test_to_val_loss_stops_at_the_first_evaluation_at_or_below_the_target(data_root):
    # An untrained model's val loss is about ln(50304) = 10.8, under 11: the first evaluation (step 2) crosses.
    # With --finish the run goes on to its hard stop (step 4), and its exit is timed after the crossing.
    tiny = ("--model.n_layer=1 --model.n_head=2 --model.n_embd=32 --model.block_size=32 --data.batch_size=4 "
            f"--train.total_batch_size=128 --optim.warmup_steps=2 --eval.val_steps=2 --data.data_root={data_root}")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--to_val_loss=11",
                             "--max_steps=4", "--eval_interval=2", "--finish", "--", tiny],
                            capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout.splitlines()[0])
    assert [step for step, _, _ in run["val"]] == [2, 4]
    step, loss, seconds = run["crossed"]
    assert step == 2 and loss == run["val"][0][1] <= 11 and 0 < seconds <= run["exit"]
    assert "1.00x" in result.stdout and "steps 2" in result.stdout


def test_the_report_marks_a_run_that_never_reached_the_target():
    reached = {"crossed": [40, 5.49, 100.0], "val": [[20, 6.0, 50.0], [40, 5.49, 100.0]], "exit": None}
    missed = {"crossed": None, "val": [[20, 6.1, 40.0], [40, 5.6, 80.0]], "exit": 90.0}
    lines = bench.report({"a": [reached, {**reached, "crossed": [40, 5.48, 120.0]}], "b": [missed]}, 5.5).splitlines()
    assert "median   110.0  1.00x" in lines[1]
    assert "(not reached)" in lines[2] and "last val 5.6000" in lines[2]


def test_bench_step_prints_each_part_of_a_step_against_the_mm_rate(data_root):
    tiny = ("--model.n_layer=2 --model.n_head=2 --model.n_embd=64 --model.block_size=64 --data.batch_size=2 "
            "--train.total_batch_size=128 --optim.warmup_steps=2")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_step.py"), "--repeats=1", "--steps=1",
                             "--threads=1", f"--data_root={data_root}", f"--shape={tiny}"],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"torch\.mm [\d.]+ GFLOP/s", result.stdout)
    for part in ("output+loss", "blocks", "optimizer", "bookkeeping", "whole step"):
        assert re.search(rf"^  {re.escape(part)} +-?[\d.]+ +-?[\d.]+ ", result.stdout, re.MULTILINE), part
    # each of the two parts, then its matmuls alone, at a rate of their own
    # (a share of the whole step, which is the difference of two runs' times, may read below 0 on a busy machine)
    assert re.search(r"^  output\+loss .*\n    matmuls +[\d.]+ +-?[\d.]+ +[\d.]+\n  blocks .*\n    matmuls +[\d.]+ "
                     r"+-?[\d.]+ +[\d.]+$", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"the step at its matmuls alone, all else free: +[\d.]+\)", result.stdout)
