"""bench_gpu.py's stopwatch, the one clock that times both trainers: it reads the wall time from the end
of optimizer step W to the end of step S, counting AdamW's steps, inside the trainer's own process."""

import os
import subprocess

from tools import bench_gpu
from conftest import ROOT, TINY, read_metrics

# A stand-in trainer: it steps a Muon and an AdamW once each per step, as train.py's optim.name=muon does
# (so only AdamW's steps may count), sleeping the seconds given on its command line before each step.
FAKE_TRAINER = """
import sys
import time

import torch

if __name__ == "__main__":
    matrix, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.zeros(2))
    muon, adamw = torch.optim.Muon([matrix]), torch.optim.AdamW([bias])
    for seconds in map(float, sys.argv[1:]):
        time.sleep(seconds)
        matrix.grad, bias.grad = torch.ones(2, 2), torch.ones(2)
        muon.step()
        adamw.step()
"""


def run_timed(script, args, first_step, last_step, record, tokens_per_step):
    command = bench_gpu.timed_command(str(script), list(map(str, args)), first_step, last_step, str(record),
                                      tokens_per_step=tokens_per_step)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_stopwatch_window_holds_the_steps_after_the_warmup_up_to_the_last_and_nothing_else(tmp_path):
    script, record = tmp_path / "fake_train.py", tmp_path / "stopwatch.json"
    script.write_text(FAKE_TRAINER)
    # Seconds slept before each step: 0.3 before step 1 (start-up, as a model build or compile), 0.8 in step
    # 2 (warm-up), 0.2 in each of the timed steps 3, 4 and 5, 0.4 in step 6 (after the window).
    sleeps = [0.3, 0.8, 0.2, 0.2, 0.2, 0.4]
    result = run_timed(script, sleeps, 2, 5, record, tokens_per_step=1000)
    assert result.returncode == 0, result.stderr
    timing = bench_gpu.read_stopwatch(str(record))
    assert (timing["first_step"], timing["last_step"], timing["tokens"]) == (2, 5, 3 * 1000)
    assert timing["peak_gib"] is None  # no CUDA in this process
    # Steps 3 to 5 slept 0.6 s (their optimizer steps take milliseconds). A window that starts a step late
    # or stops a step early reads about 0.4 s; one that starts a step early (1.4 s), stops a step late
    # (1.0 s), counts Muon's steps too (the end of step 1 to the middle of step 3: 1.0 s) or starts with the
    # process (2.5 s and the imports) reads 0.9 s or more.
    assert 0.6 <= timing["seconds"] < 0.9, timing


def test_stopwatch_on_train_py_counts_its_steps_and_matches_its_own_step_times(tmp_path, data_root):
    record, out = tmp_path / "stopwatch.json", tmp_path / "run"
    args = [*TINY, "--train.device=cpu", "--train.max_steps=6", f"--data.data_root={data_root}",
            f"--train.out_dir={out}", "--train.no_evals=true", "--train.no_checkpoints=true",
            "--checkpoint.load=never", "--log.metrics_collect_interval=1"]
    result = run_timed(os.path.join(ROOT, "train.py"), args, 2, 5, record, tokens_per_step=128)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    timing = bench_gpu.read_stopwatch(str(record))
    assert timing["last_step"] - timing["first_step"] == 3 and timing["tokens"] == 3 * 128
    assert timing["seconds"] > 0
    # train.py times each step from the end of the step before (metrics.StepClock); on a CPU nothing runs
    # ahead, so its steps 3 to 5 add up to the stopwatch's window. A window one step off would differ by a
    # whole step.
    own = {row["step"]: row["throughput/step_time_sec"] for row in read_metrics(out) if row["step"] in (3, 4, 5)}
    assert sorted(own) == [3, 4, 5]
    assert abs(timing["seconds"] - sum(own.values())) < min(own.values()) / 2, (timing, own)
