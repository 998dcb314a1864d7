"""debug.py: module traces, checkpoint comparison, stacks of every rank, the collective timeout, and
the switches train.deterministic and train.cancel_check_interval."""

import json
import os
import shutil
import signal
import subprocess
import sys
import socket
import time
from contextlib import nullcontext

import pytest
import torch

from lab import debug
import run_dir
from checkpoint import sha256_file
from conftest import ROOT, TINY, read_metrics, run_in_process, run_train
from hellaswag_fixture import tiny_model

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


def run_debug(*args):
    """`python debug.py ARGS`; the comparisons run in this process (they read files and print), `stacks`
    in a process of its own (it signals other processes and waits for their files)."""
    if args[0] != "stacks":
        return run_in_process(args, debug.main)
    return subprocess.run([sys.executable, "lab/debug.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


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


def trace(run, model, step=1):
    """`run`'s trace of `model` at `step`, as training writes it."""
    run.mkdir(exist_ok=True)
    debug.trace_forward(model, Loader(), nullcontext(), str(run), step)
    return run


def model_gone_nan():
    """A model whose second block's MLP holds one NaN weight: every module from there on outputs NaN."""
    model = tiny_model()
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = float("nan")
    return model


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
    # first micro-batch
    assert index["calls"][0]["inputs"] == [[4, 32]] and index["calls"][0]["output"] == [[4, 32, 32]]
    assert sorted(os.listdir(traced_runs / "a" / "traces")) == ["step1", "step3"]
    first = json.loads((traced_runs / "first" / "traces" / "step3" / "index.json").read_text())
    # The same modules; the output layer runs once per slice of the chunked loss, so its calls follow the rows.
    assert first["calls"][0]["inputs"] == [[1, 32]] and {c["name"] for c in first["calls"]} == set(names)
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


def test_a_run_gone_nan_parts_at_the_first_module_with_nan_whatever_the_tolerance(tmp_path, capsys):
    good, bad = trace(tmp_path / "good", tiny_model()), trace(tmp_path / "nan", model_gone_nan())
    assert debug.main(["compare-traces", str(good), str(bad), "--atol=1e9"]) == 1  # as any parting: status 1
    out = capsys.readouterr().out
    assert "the runs first part at step 1 in transformer.h.1.mlp.c_fc (NaN at different places: 0 and " in out
    assert debug.main(["compare-traces", str(bad), str(good)]) == 1  # whichever run went NaN


def test_the_same_nan_at_the_same_places_in_both_runs_is_no_difference(tmp_path, capsys):
    a, b = trace(tmp_path / "a", model_gone_nan()), trace(tmp_path / "b", model_gone_nan())
    assert debug.main(["compare-traces", str(a), str(b)]) == 0
    assert "no module parts beyond atol=0.0, rtol=0.0 at step(s) 1" in capsys.readouterr().out


def with_values(tensor, positions, value):
    tensor = tensor.clone()
    for position in positions:
        tensor[position] = value
    return tensor


@pytest.mark.parametrize("in_a, in_b, why", [
    ([], [(0, 1)], "NaN at different places: 0 and 1 of 8 values"),  # in one run only
    ([(0, 0)], [(1, 2)], "NaN at different places: 1 and 1 of 8 values"),  # at other places
    ([(0, 0)], [(0, 0), (1, 3)], "NaN at different places: 1 and 2 of 8 values"),  # more of them
])
def test_nan_in_one_run_only_or_elsewhere_or_more_often_parts_there(tmp_path, capsys, in_a, in_b, why):
    tokens, clean = torch.arange(8).view(2, 4), torch.randn(2, 4)
    for run, positions in (("a", in_a), ("b", in_b)):
        nan = with_values(clean, positions, float("nan"))
        calls = [{"name": name, "inputs": [tokens], "output": [output]}
                 for name, output in (("transformer.wte", clean), ("transformer.h.0", nan), ("model", nan))]
        (tmp_path / run / "traces" / "step1").mkdir(parents=True)
        torch.save({"step": 1, "calls": calls}, tmp_path / run / "traces" / "step1" / "rank0.pt")
    assert debug.compare_traces(str(tmp_path / "a"), str(tmp_path / "b")) == (1, "transformer.h.0")
    assert f"the runs first part at step 1 in transformer.h.0 ({why})" in capsys.readouterr().out


@pytest.mark.parametrize("value_b, why", [
    (5.0, "+Inf at different places: 1 and 0 of 4 values"),  # +Inf against a finite value
    (float("-inf"), "+Inf at different places: 1 and 0 of 4 values"),  # +Inf against -Inf
    (float("nan"), "NaN at different places: 0 and 1 of 4 values"),
])
def test_compare_state_lists_nan_or_inf_in_one_checkpoint_first(monkeypatch, capsys, value_b, why):
    clean, nan = torch.arange(4.0), with_values(torch.arange(4.0), [2], float("nan"))
    states = {"A": {"w": clean, "x": with_values(clean, [1], float("inf")), "both_nan": nan, "small": clean},
              "B": {"w": clean, "x": with_values(clean, [1], value_b), "both_nan": nan.clone(), "small": clean + 1e-3}}
    monkeypatch.setattr(debug, "named_state", lambda path, model_module: (path, states[path]))
    assert debug.compare_state("A", "B") == 2  # x and small; NaN at the same place in both is no difference
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 of 4 tensors differ") and lines[2].split()[:3] == ["x", "inf", "inf"]
    assert lines[2].endswith(f"({why})") and lines[3].split()[0] == "small"
    states["B"] = {**states["A"]}
    assert debug.compare_state("A", "B") == 0 and capsys.readouterr().out.startswith("identical: all 4 tensors")


@pytest.mark.parametrize("atol, rtol", [("nan", "0"), ("-1", "0"), ("0", "nan")])
def test_tolerances_must_be_numbers_of_zero_or_more(tmp_path, atol, rtol):
    run = trace(tmp_path / "run", tiny_model())
    with pytest.raises(debug.DebugError, match=r"--atol and --rtol must be numbers of 0 or more .*; give tolerances"):
        debug.main(["compare-traces", str(run), str(run), f"--atol={atol}", f"--rtol={rtol}"])


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


def test_stacks_signals_a_rank_proven_by_its_pid_and_start_time(tmp_path):
    undo = run_dir.register_stack_dump(str(tmp_path), 0)  # this process plays rank 0
    try:
        info = json.loads((tmp_path / "stacks" / "rank0.pid").read_text())
        assert info["pid"] == os.getpid() and info["start_time"] == run_dir.process_start_time(os.getpid())
        dumps, silent = debug.collect_stacks(str(tmp_path), wait=10)
        assert silent == [] and "test_debug.py" in dumps[0]  # our own stack, dumped on SIGUSR1
    finally:
        undo()
    assert not (tmp_path / "stacks" / "rank0.pid").exists()


def point_at(pid_path, pid):
    info = json.loads(pid_path.read_text())
    pid_path.write_text(json.dumps({**info, "pid": pid}))


@pytest.mark.parametrize("proc, report", [
    ("/proc", "rank 0: stale pid file, pid {pid} is now another process; not signalled"),  # the pid was reused
    ("no-proc", "rank 0: pid {pid} cannot be proven to be this run's rank without"),  # nothing to prove it with
])
def test_a_pid_file_naming_an_unrelated_live_process_does_not_signal_it(tmp_path, monkeypatch, capsys, proc, report):
    if proc != "/proc":
        monkeypatch.setattr(run_dir, "PROC", str(tmp_path / proc))
    unrelated = subprocess.Popen(["sleep", "30"])  # SIGUSR1 would end it: its default action is to terminate
    undo = run_dir.register_stack_dump(str(tmp_path / "run"), 0)
    try:
        # The file a rank wrote, but its pid now names another process, as after a kill -9 and a reused pid.
        point_at(tmp_path / "run" / "stacks" / "rank0.pid", unrelated.pid)
        with pytest.raises(debug.DebugError, match="no rank registered in .* is running now"):
            debug.collect_stacks(str(tmp_path / "run"), wait=1)
        assert report.format(pid=unrelated.pid) in capsys.readouterr().out
        time.sleep(0.5)
        assert unrelated.poll() is None  # still alive: never signalled
    finally:
        unrelated.kill()
        undo()


def test_stale_and_unreadable_pid_files_are_reported_in_one_line_each(tmp_path):
    ended = subprocess.Popen(["true"])
    ended.wait()
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    (stacks / "rank0.pid").write_text(json.dumps({"pid": ended.pid, "host": socket.gethostname(), "rank": 0,
                                                   "start_time": 1}))  # a rank killed with -9 left it behind
    (stacks / "rank1.pid").write_text('{"pid": 12')  # cut off mid-write
    result = run_debug("stacks", str(tmp_path), "--wait=1")
    assert result.returncode == 1 and result.stdout.splitlines() == [
        f"rank 0: stale pid file, pid {ended.pid} has ended; not signalled",
        f"{stacks / 'rank1.pid'} is unreadable (JSONDecodeError); not signalled"]
    assert result.stderr.startswith(f"error: no rank registered in {stacks} is running now (see above);")


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

    loader = Loader()
    debug.trace_forward(tiny_model(), loader, nullcontext(), str(tmp_path), 7)
    assert (tmp_path / "traces" / "step7" / "rank0.pt").exists() and loader.position == 0  # batch left for the step
    monkeypatch.setattr(debug.shutil, "disk_usage", lambda path: namedtuple("Usage", "total used free")(1, 1, 1000))
    debug.trace_forward(tiny_model(), loader, nullcontext(), str(tmp_path), 8)
    assert not (tmp_path / "traces" / "step8").exists()
    assert "the trace of step 8 would take" in capsys.readouterr().err


def test_compare_state_names_the_moments_of_a_gpt_of_your_own(tmp_path, data_root, capsys):
    """The optimizer's moments are named by rebuilding the run's parameters in order: from the run's own class
    (train.model_module), not model.py's (a fork with a parameter of its own was an IndexError traceback)."""
    module = tmp_path / "my_gpt.py"
    module.write_text("import torch\nimport torch.nn as nn\n\nimport model\n\n\nclass GPT(model.GPT):\n"
                      "    def __init__(self, config, loss_path='chunked'):\n"
                      "        super().__init__(config, loss_path)\n"
                      "        self.logit_bias = nn.Parameter(torch.zeros(config.vocab_size))\n\n"
                      "    def logits(self, h):\n        return super().logits(h) + self.logit_bias\n")
    run_train([*TINY, f"--data.data_root={data_root}", f"--train.model_module={module}", "--train.max_steps=2",
               "--checkpoint.interval=2", "--eval.interval=0", f"--train.out_dir={tmp_path / 'run'}"])
    capsys.readouterr()
    assert debug.compare_state(str(tmp_path / "run"), str(tmp_path / "run"), model_module=str(module)) == 0
    assert "optim/logit_bias/exp_avg" in debug.named_state(str(tmp_path / "run"), str(module))[1]


def test_compare_state_on_a_checkpoint_grouped_by_other_code_is_one_sentence(tmp_path, data_root):
    """Moments saved while the code grouped the parameters otherwise (here: an output layer it called a matrix,
    for Muon) cannot be named by today's grouping: one sentence, not an IndexError."""
    module = tmp_path / "my_gpt.py"
    source = ("import torch.nn as nn\n\nimport model\n\n\nclass GPT(model.GPT):\n"
              "    def __init__(self, config, loss_path='chunked'):\n"
              "        super().__init__(config, loss_path)\n        del self.lm_head\n"
              "        self.unembed = nn.Linear(config.n_embd, config.vocab_size, bias=False)\n\n"
              "    def logits(self, h):\n        return self.unembed(h)\n")
    module.write_text(source + "\n    def param_groups(self):\n        groups = super().param_groups()\n"
                               "        matrices = groups['matrix'] + groups['output']\n"
                               "        return {**groups, 'output': [], 'matrix': matrices}\n")
    run_train([*TINY, f"--data.data_root={data_root}", f"--train.model_module={module}", "--optim.name=muon",
               "--train.max_steps=2", "--checkpoint.interval=2", "--eval.interval=0",
               f"--train.out_dir={tmp_path / 'run'}"])
    module.write_text(source)
    with pytest.raises(debug.DebugError, match="holds optimizer state grouped otherwise than this code groups"):
        debug.named_state(str(tmp_path / "run"), str(module))
