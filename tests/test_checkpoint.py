import hashlib
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from run_dir import claim_for_fresh_start
from checkpoint import (Checkpointer, CheckpointError, TrainState, find_checkpoints, newest_valid_checkpoint,
                        verify_checkpoint)
from config import CheckpointConfig
from conftest import ROOT, TINY, assert_one_sentence, read_metrics, run_train


def args(data_root, out, *extra):
    return TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=5",
                   "--model.dropout=0.1", *extra]


def losses(out):
    return {r["step"]: r["train/loss"] for r in read_metrics(out)}


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_resume_after_a_hard_stop_is_bit_exact(data_root, tmp_path, async_save):
    saving = [f"--checkpoint.async_save={async_save}", "--checkpoint.interval=3"]
    run_train(args(data_root, tmp_path / "full", "--train.max_steps=20"))
    stopped = run_train(args(data_root, tmp_path / "split", "--train.max_steps=20", "--train.hard_stop=10", *saving))
    assert "checkpoint step10" in stopped.stdout
    resumed = run_train(args(data_root, tmp_path / "split", "--train.max_steps=20", *saving))
    assert "at step 10" in resumed.stdout
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert list(split) == list(range(1, 21))  # metrics.jsonl: no step missing, none twice
    for step in range(11, 21):
        assert split[step] == full[step]  # bit-identical, dropout included


def test_resume_on_a_different_world_size_continues_the_same_data(data_root, tmp_path):
    common = ["--train.max_steps=8", "--train.total_batch_size=256", "--model.dropout=0.0"]
    run_train(args(data_root, tmp_path / "one", *common))
    run_train(args(data_root, tmp_path / "two", *common, "--train.hard_stop=4"), nproc=2)
    resumed = run_train(args(data_root, tmp_path / "two", *common))  # resumed by one rank, 2 micro-steps
    assert "saved by 2 rank(s) and this run has 1" in resumed.stdout  # RNG states stay with their ranks
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert list(two) == list(range(1, 9))
    for step in range(5, 9):
        assert two[step] == pytest.approx(one[step], rel=1e-5)


def sigterm_after(out, steps, *extra):
    """A long run of train.py sent SIGTERM once `steps` rows are in its metrics: its exit and output."""
    cmd = [sys.executable, str(ROOT / "train.py")] + args(*extra)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= steps):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr


def test_sigterm_without_checkpoints_promises_none(data_root, tmp_path):
    out = tmp_path / "run"
    _, _, stderr = sigterm_after(out, 2, data_root, out, "--train.max_steps=100000", "--train.no_checkpoints=true")
    assert "SIGTERM received: finishing this step, then exiting" in stderr, stderr
    assert "checkpoint" not in stderr and not find_checkpoints(out)


def test_sigterm_saves_a_checkpoint_and_the_resumed_run_continues_at_the_next_step(data_root, tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = sigterm_after(out, 3, data_root, out, "--train.max_steps=100000", "--checkpoint.interval=0")
    assert code == 0, stderr
    assert "SIGTERM received" in stderr and "stopped by SIGTERM after step" in stdout
    stopped_at = find_checkpoints(out)[-1][0]
    assert stopped_at >= 3 and read_metrics(out)[-1]["step"] == stopped_at
    run_train(args(data_root, out, f"--train.max_steps={stopped_at + 2}"))
    assert [r["step"] for r in read_metrics(out)][-3:] == [stopped_at, stopped_at + 1, stopped_at + 2]


def test_cancel_file_stops_the_run_with_a_checkpoint(data_root, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    cmd = [sys.executable, str(ROOT / "train.py")] + args(data_root, out, "--train.max_steps=100000",
                                                          "--checkpoint.interval=0")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2):
        time.sleep(0.2)
    (out / "CANCEL").touch()
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "canceled by" in stdout and not (out / "CANCEL").exists()
    assert find_checkpoints(out)[-1][0] == read_metrics(out)[-1]["step"]


def test_retention_keeps_last_permanent_fixed_and_newest_ephemeral(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=10", "--checkpoint.interval=4", "--checkpoint.keep_last=2",
                   "--checkpoint.ephemeral_interval=1", "--checkpoint.fixed_steps=2,3"))
    # permanent: 4, 8, 10 (final) -> keep 8 and 10; fixed 2 and 3 always; ephemeral 9 replaced by 10.
    assert [step for step, _ in find_checkpoints(out)] == [2, 3, 8, 10]
    assert os.readlink(out / "latest") == "step10"


def checkpointer(out, **settings):
    """A Checkpointer of `out` on rank 0, with checkpoint.* `settings`."""
    return Checkpointer(str(out), CheckpointConfig(**settings), {}, is_master=True)


def test_retention_never_deletes_the_newest_checkpoint(tmp_path):
    snap = {"model": {"w": torch.ones(2)}}
    saver = checkpointer(tmp_path, keep_last=1)
    saver.write(1, snap, "permanent")
    saver.write(2, snap, "ephemeral")
    saver.wait()
    assert [s for s, _ in find_checkpoints(tmp_path)] == [1, 2]
    saver.write(3, snap, "permanent")
    saver.wait()
    assert [s for s, _ in find_checkpoints(tmp_path)] == [3]


def test_async_and_sync_saves_write_identical_files(tmp_path):
    torch.manual_seed(0)
    snapshot = {"model": {"w": torch.randn(64, 64)}, "optim": {"state": {0: torch.randn(64)}},
                "trainer": {"step": 7, "rng": [torch.get_rng_state()]}}
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    for name, async_save in [("sync", False), ("async", True)]:
        os.makedirs(tmp_path / name)
        saver = checkpointer(tmp_path / name, keep_last=0, async_save=async_save)
        torch.manual_seed(0)
        saver.save(7, "permanent", model, optimizer, TrainState(step=7), torch.Generator().manual_seed(0))
        saver.wait()
    for file in ["model.pt", "optim.pt", "trainer.pt", "COMPLETE"]:
        a = (tmp_path / "sync" / "step7" / file).read_bytes()
        assert a == (tmp_path / "async" / "step7" / file).read_bytes(), file


def test_truncated_checkpoint_file_is_detected_and_skipped(data_root, tmp_path, capsys):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=6", "--checkpoint.interval=3"))
    model_file = out / "step6" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        verify_checkpoint(str(out / "step6"))
    assert newest_valid_checkpoint(str(out)) == str(out / "step3")
    assert "warning: skipping checkpoint" in capsys.readouterr().err  # one line, no Python warning's source line
    resumed = run_train(args(data_root, out, "--train.max_steps=6"))
    assert "resumed from" in resumed.stdout and "step3 at step 3" in resumed.stdout


KILLER = """
import sys, torch
sys.path.insert(0, {root!r})
from checkpoint import Checkpointer, find_checkpoints
from config import CheckpointConfig
snapshot = {{"model": {{"w": torch.randn(512, 1024)}}, "optim": {{"m": torch.randn(512, 1024)}}}}
saver = Checkpointer({out!r}, CheckpointConfig(keep_last=0), {{}}, is_master=True)
print("saving", flush=True)
step = max((s for s, _ in find_checkpoints({out!r})), default=0) + 1  # a resumed run goes on
while True:
    saver.write(step, snapshot, "ephemeral")
    step += 1
"""


def test_kill_9_at_random_moments_never_leaves_an_unloadable_latest(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    script = tmp_path / "saver.py"
    script.write_text(KILLER.format(root=str(ROOT), out=str(out)))
    rng = random.Random(0)
    for attempt in range(6):
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "saving"  # torch is imported (slow on a busy machine)
        time.sleep(0.2 + rng.random() * 1.5)  # then it saves continuously
        proc.kill()
        proc.wait()
        latest = out / "latest"
        if not latest.exists():
            continue
        target = out / os.readlink(latest)
        verify_checkpoint(str(target))  # complete, and every checksum matches
        torch.load(target / "model.pt", weights_only=True)
    assert find_checkpoints(out), "the saver never finished a checkpoint"


def test_load_always_without_a_checkpoint_fails_in_one_sentence(data_root, tmp_path):
    result = run_train(args(data_root, tmp_path / "run", "--checkpoint.load=always"), check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "checkpoint.load=always but" in result.stderr


def test_a_different_run_in_out_dir_is_not_overwritten(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=2"))
    before = hashlib.sha256((out / "step2" / "model.pt").read_bytes()).hexdigest()
    fresh = run_train(args(data_root, out, "--train.max_steps=2", "--checkpoint.load=never"), check=False)
    assert fresh.returncode != 0 and "already holds another run" in fresh.stderr
    assert hashlib.sha256((out / "step2" / "model.pt").read_bytes()).hexdigest() == before
    run_train(
        args(data_root, out, "--train.max_steps=2", "--checkpoint.load=never", "--checkpoint.save_overwrite=true")
    )
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


def test_restart_of_the_same_run_before_its_first_checkpoint_is_allowed(tmp_path):
    config = {"model": {"n_layer": 2}, "data": {"dataset": "x"}, "optim": {}, "train": {"seed": 1}}
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    claim_for_fresh_start(str(tmp_path), config, save_overwrite=False)
    other = {**config, "model": {"n_layer": 3}}
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    with pytest.raises(CheckpointError, match="already holds another run"):
        claim_for_fresh_start(str(tmp_path), other, save_overwrite=False)


def test_loading_a_different_model_shape_names_the_field(data_root, tmp_path):
    run_train(args(data_root, tmp_path / "a", "--train.max_steps=2"))
    result = run_train(args(data_root, tmp_path / "b", "--train.max_steps=2", "--model.n_layer=3",
                            f"--checkpoint.load_path={tmp_path / 'a'}"), check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "has model.n_layer=2 but this run has model.n_layer=3" in result.stderr


def test_load_path_without_trainer_state_fine_tunes_from_step_zero(data_root, tmp_path):
    run_train(args(data_root, tmp_path / "a", "--train.max_steps=4"))
    tuned = run_train(args(data_root, tmp_path / "b", "--train.max_steps=2", f"--checkpoint.load_path={tmp_path / 'a'}",
                           "--checkpoint.load_trainer_state=false", "--checkpoint.load_optim=false"))
    assert f"loaded weights from {tmp_path / 'a' / 'step4'}; the run starts at step 0" in tuned.stdout
    rows = read_metrics(tmp_path / "b")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["train/loss"] < read_metrics(tmp_path / "a")[0]["train/loss"]  # starts from trained weights


@pytest.mark.parametrize("folder", ["empty", "no weights", "no config", "bad json"])
def test_a_load_path_that_holds_no_weights_is_refused_not_trained_from_scratch(data_root, tmp_path, folder):
    """The user asked for weights: an empty folder or a broken Hugging Face folder is one sentence (it used to warn
    and train a random GPT-2 to the end)."""
    source = tmp_path / "source"
    source.mkdir()
    if folder == "no weights":
        (source / "config.json").write_text('{"model_type": "gpt2"}')
    elif folder in ("no config", "bad json"):
        (source / "model.safetensors").write_bytes(b"weights")
        if folder == "bad json":
            (source / "config.json").write_text("{not json")
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}",
                               "--train.max_steps=2", f"--checkpoint.load_path={source}"], check=False)
    assert_one_sentence(result, f"checkpoint.load_path")
    assert not (tmp_path / "run").exists()


def test_a_load_path_ignored_for_the_runs_own_checkpoint_is_said_once(data_root, tmp_path):
    common = TINY + [f"--data.data_root={data_root}", "--eval.interval=0"]
    run_train(common + [f"--train.out_dir={tmp_path / 'base'}", "--train.max_steps=2"])
    run_train(common + [f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=2"])
    result = run_train(common + [f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=4",
                                 f"--checkpoint.load_path={tmp_path / 'base'}"])
    assert result.stdout.count("is ignored because") == 1 and "at step 2" in result.stdout


# The last commit before the optional features moved to lab/ and the core was reshaped.
BEFORE_THE_MOVE = "423d8d0"


def test_a_run_saved_before_the_move_to_lab_resumes_bit_for_bit(data_root, tmp_path):
    """A run the code before the move saved after step 4 resumes under today's code exactly as the old
    code goes on: the same losses at steps 5 to 8, to the bit. (The plain F.cross_entropy path, so the
    comparison is of the move alone.)"""
    old = tmp_path / "old"
    made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), BEFORE_THE_MOVE],
                          capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"needs the project's git history to run the code of {BEFORE_THE_MOVE} ({made.stderr.strip()})")
    try:
        # (the old code's default AdamW peak, named: the quick start's has changed since)
        common = args(data_root, None, "--train.max_steps=8", "--checkpoint.interval=4", "--train.loss_path=full",
                      "--optim.lr=3e-3")
        common = [a for a in common if not a.startswith("--train.out_dir=")]

        def old_code(out, *extra):
            subprocess.run([sys.executable, str(old / "train.py"), *common, f"--train.out_dir={out}", *extra],
                           cwd=old, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

        old_code(tmp_path / "through")  # the old code, steps 1 to 8
        old_code(tmp_path / "moved", "--train.hard_stop=4")  # the old code, steps 1 to 4
        resumed = run_train(common + [f"--train.out_dir={tmp_path / 'moved'}"])  # today's code, steps 5 to 8
        assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
        through, moved = read_metrics(tmp_path / "through"), read_metrics(tmp_path / "moved")
        assert [r["train/loss"] for r in moved[4:]] == [r["train/loss"] for r in through[4:]]
        assert [r["step"] for r in moved] == list(range(1, 9))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], capture_output=True)


def test_a_command_that_trains_nothing_changes_no_file(data_root, tmp_path):
    """Already trained, a hard_stop at or below the checkpoint, the run's own config.json: each says
    there is nothing to do, and every file of the run folder is as it was, byte for byte."""
    import hashlib

    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=3", "--checkpoint.interval=3"))

    def files():
        return {p.relative_to(out): hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*")
                if p.is_file()}

    before = files()
    for extra in ([], ["--train.hard_stop=2"]):
        assert "nothing to do" in run_train(args(data_root, out, "--train.max_steps=3", *extra)).stdout
    assert "nothing to do" in run_train([str(out / "config.json")]).stdout
    assert files() == before


def test_a_run_whose_every_checkpoint_is_damaged_is_called_this_run_with_its_first_problem(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2"))
    for step, path in find_checkpoints(out):
        with open(os.path.join(path, "model.pt"), "r+b") as f:
            f.seek(100)
            f.write(b"XXXX")
    refused = run_train(args(data_root, out, "--train.max_steps=6", "--checkpoint.interval=2"), check=False)
    assert refused.returncode == 1 and "holds this run, but none of its checkpoints is usable" in refused.stderr
    assert "step4/model.pt does not match its checksum" in refused.stderr and "another run" not in refused.stderr
    assert "--checkpoint.save_overwrite=true" in refused.stderr
