"""debug.py: module traces, checkpoint comparison, stacks of every rank, the collective timeout, and
the switches train.deterministic and train.cancel_check_interval."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import debug
from checkpoint import sha256_file
from conftest import ROOT, TINY, read_metrics, run_train

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


def run_debug(*args):
    return subprocess.run([sys.executable, "debug.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def traced_runs(data_root, tmp_path_factory):
    """Two identical runs and one with another learning rate, traced at steps 1 and 3, and one untraced."""
    root = tmp_path_factory.mktemp("traced")
    common = TINY + [f"--data.data_root={data_root}", "--train.max_steps=4", "--eval.interval=0"]
    for name, extra in [("a", []), ("b", []), ("lr", ["--optim.lr=1e-3"]), ("first", ["--debug.trace_sequences=1"])]:
        run_train(common + [f"--train.out_dir={root / name}", "--debug.trace_steps=1,3", "--debug.trace_sequences=0"]
                  + extra)
    run_train(common + [f"--train.out_dir={root / 'untraced'}"])
    return root


def test_traces_hold_every_module_and_leave_training_unchanged(traced_runs):
    index = json.loads((traced_runs / "a" / "traces" / "step3" / "index.json").read_text())
    names = [call["name"] for call in index["calls"]]
    assert names[0] == "transformer.wte" and names[-1] == "model" and "transformer.h.1.mlp.c_fc" in names
    assert index["calls"][0]["inputs"] == [[4, 32]] and index["calls"][0]["output"] == [[4, 32, 32]]  # first micro-batch
    assert sorted(os.listdir(traced_runs / "a" / "traces")) == ["step1", "step3"]
    first = json.loads((traced_runs / "first" / "traces" / "step3" / "index.json").read_text())
    assert first["calls"][0]["inputs"] == [[1, 32]] and len(first["calls"]) == len(index["calls"])
    traced, untraced = read_metrics(traced_runs / "a"), read_metrics(traced_runs / "untraced")
    assert [r["train/loss"] for r in traced] == [r["train/loss"] for r in untraced]  # bit for bit


def test_traces_of_identical_runs_compare_equal(traced_runs):
    result = run_debug("compare-traces", str(traced_runs / "a"), str(traced_runs / "b"))
    assert result.returncode == 0, result.stderr
    assert "no module parts beyond atol=0.0, rtol=0.0 at step(s) 1, 3" in result.stdout


def test_a_changed_learning_rate_is_caught_at_the_first_step_and_module_it_reaches(traced_runs):
    # Step 1's forward uses the initial weights (equal); the first update differs, so step 3's first
    # module, the token embedding, is where the runs part.
    result = run_debug("compare-traces", str(traced_runs / "a"), str(traced_runs / "lr"))
    assert result.returncode == 1
    assert "the runs first part at step 3 in transformer.wte" in result.stdout
    assert run_debug("compare-traces", str(traced_runs / "a"), str(traced_runs / "lr"), "--step=1").returncode == 0
    loose = run_debug("compare-traces", str(traced_runs / "a"), str(traced_runs / "lr"), "--atol=100")
    assert loose.returncode == 0  # the differences are small: a tolerance that large lets them pass
    missing = run_debug("compare-traces", str(traced_runs / "a"), str(traced_runs / "untraced"))
    assert missing.returncode != 0 and "has no traces/ folder; train it with --debug.trace_steps" in missing.stderr


def test_compare_state_finds_a_perturbed_parameter(traced_runs, tmp_path):
    checkpoint = traced_runs / "a" / "step4"
    same = run_debug("compare-state", str(checkpoint), str(traced_runs / "b" / "step4"))
    assert same.returncode == 0 and same.stdout.startswith("identical: all ")
    copy = tmp_path / "step4"
    shutil.copytree(checkpoint, copy)
    state = torch.load(copy / "model.pt", weights_only=True)
    state["transformer.h.1.attn.c_proj.weight"][3, 5] += 0.01
    torch.save(state, copy / "model.pt")
    marker = json.loads((copy / "COMPLETE").read_text())  # a checkpoint written that way, checksum and all
    marker["files"]["model.pt"] = sha256_file(copy / "model.pt")
    (copy / "COMPLETE").write_text(json.dumps(marker))
    result = run_debug("compare-state", str(checkpoint), str(copy))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("1 of ") and lines[2].split()[0] == "transformer.h.1.attn.c_proj.weight"
    assert float(lines[2].split()[1]) == pytest.approx(0.01, rel=1e-3)
    moments = run_debug("compare-state", str(checkpoint), str(traced_runs / "lr" / "step4"), "--top=200")
    assert "optim/transformer.wte.weight/exp_avg " in moments.stdout  # the AdamW moments are named and compared


def test_stacks_of_every_rank_then_a_hung_rank_ends_the_run_with_a_message(data_root, tmp_path):
    out = tmp_path / "run"
    log = open(tmp_path / "log.txt", "w")
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            str(ROOT / "train.py"), *TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}",
                            "--train.max_steps=100000", "--eval.interval=0", "--log.interval=100",
                            "--checkpoint.interval=0", "--train.dist_timeout=6", "--train.total_batch_size=256"],
                           cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert job.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]  # training, not failed at start
        assert sorted(os.listdir(out / "stacks")) == ["rank0.pid", "rank0.txt", "rank1.pid", "rank1.txt"]
        result = run_debug("stacks", str(out))
        assert result.returncode == 0, result.stdout + result.stderr
        for rank in (0, 1):
            assert f"==================== rank {rank}\n" in result.stdout
            assert (out / "stacks" / f"rank{rank}.txt").read_text().count('train.py", line') >= 2
        assert "where each rank is" in result.stdout
        table = result.stdout.split("side by side")[1].splitlines()
        assert table[1].split() == ["rank", "0", "|", "rank", "1"] and table[2].count("train.py:") == 2
        # Freeze rank 1: rank 0 waits at the next collective until train.dist_timeout, then says so.
        rank1 = json.loads((out / "stacks" / "rank1.pid").read_text())["pid"]
        os.kill(rank1, signal.SIGSTOP)
        start = time.monotonic()
        while "waited train.dist_timeout" not in (tmp_path / "log.txt").read_text() and time.monotonic() - start < 90:
            time.sleep(0.5)
        waited = time.monotonic() - start
        os.kill(rank1, signal.SIGCONT)
        job.wait(timeout=120)
    finally:
        job.kill()
    text = (tmp_path / "log.txt").read_text()
    assert "error: rank 0 waited train.dist_timeout seconds at a collective for a rank that never came" in text
    assert 5 < waited < 60 and job.returncode != 0


def test_deterministic_runs_match_and_switch_the_flags(data_root, tmp_path):
    common = TINY + [f"--data.data_root={data_root}", "--train.max_steps=3", "--eval.interval=3"]
    run_train(common + [f"--train.out_dir={tmp_path / 'a'}", "--train.deterministic=true"])
    run_train(common + [f"--train.out_dir={tmp_path / 'b'}"])
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["train/loss"] for r in a] == [r["train/loss"] for r in b] and a[-1]["val/loss"] == b[-1]["val/loss"]
    try:
        debug.make_deterministic()
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_cancel_check_interval_sets_when_ranks_agree_on_stopping(data_root, tmp_path):
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=20",
                               "--train.time_limit=0.001", "--train.cancel_check_interval=3", "--eval.interval=0"])
    assert "time limit" in result.stdout and "after step 3;" in result.stdout
    assert (tmp_path / "step3").is_dir()


@pytest.mark.parametrize("override, message", [
    ("--train.dist_timeout=0", "train.dist_timeout must be greater than 0"),
    ("--train.cancel_check_interval=0", "train.cancel_check_interval must be at least 1"),
    ("--debug.trace_steps=0,3", "debug.trace_steps must be steps of 1 or more"),
])
def test_debug_settings_are_checked(tmp_path, override, message):
    result = run_train([f"--train.out_dir={tmp_path / 'run'}", override], check=False)
    assert result.returncode != 0 and message in result.stderr and not (tmp_path / "run").exists()


def test_a_trace_too_large_for_the_disk_is_not_written(tmp_path, monkeypatch, capsys):
    from collections import namedtuple
    from contextlib import nullcontext

    from hellaswag_fixture import tiny_model

    class Loader:  # the two methods trace_forward uses, and the batch
        position = 0

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]

        def next_batch(self):
            self.position += 1
            tokens = torch.arange(2 * 17).view(2, 17)
            return tokens[:, :-1], tokens[:, 1:]

    loader = Loader()
    debug.trace_forward(tiny_model(), loader, nullcontext(), str(tmp_path), 7)
    assert (tmp_path / "traces" / "step7" / "rank0.pt").exists() and loader.position == 0  # batch left for the step
    monkeypatch.setattr(debug.shutil, "disk_usage", lambda path: namedtuple("Usage", "total used free")(1, 1, 1000))
    debug.trace_forward(tiny_model(), loader, nullcontext(), str(tmp_path), 8)
    assert not (tmp_path / "traces" / "step8").exists()
    assert "the trace of step 8 would take" in capsys.readouterr().err
