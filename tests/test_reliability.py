"""Nothing lost, nothing silently accepted: one test per defect found by trying to break the trainer,
and a full disk during a checkpoint and a metrics append."""

import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from checkpoint import find_checkpoints
from config import ConfigError, parse_args
import warm_python
from conftest import ROOT, TINY, assert_one_sentence, read_metrics, run_train
from data import DataError, TokenLoader
from prepare_data import prepare_text, write_shard


def args(data_root, out, *extra):
    return TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0", *extra]


def losses(out):
    return {r["step"]: r["train/loss"] for r in read_metrics(out)}


def start_train(argv):
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_rows(out, n, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError("the run never logged")


# ----------------------------------------------------------------------------- 1-7: work lost or damaged


def test_a_second_training_into_the_same_folder_fails_and_touches_nothing(data_root, tmp_path):
    out = tmp_path / "run"
    first = start_train(args(data_root, out, "--train.max_steps=100000", "--checkpoint.interval=0"))
    try:
        wait_for_rows(out, 2)
        before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
        second = run_train(args(data_root, out, "--train.max_steps=5", "--optim.lr=1e-2"), check=False)
        assert second.returncode != 0 and "Traceback" not in second.stderr
        assert "is in use by another training (pid" in second.stderr
        assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name in before
                and p.name != "metrics.jsonl"} == {k: v for k, v in before.items() if k != "metrics.jsonl"}
    finally:
        first.kill()  # a crash: the lock stays behind, stale
        first.wait()
    third = run_train(args(data_root, out, "--train.max_steps=2"))
    assert "removing the lock of a run that ended without releasing it" in third.stdout
    assert not (out / ".lock").exists()  # released on exit


def test_a_cut_off_last_metrics_line_is_dropped_on_resume(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=4"))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train/lo')
    resumed = run_train(args(data_root, out, "--train.max_steps=6"))
    assert "dropping the cut-off last line" in resumed.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


def limited_run(argv, max_file_bytes):
    """train.py with every file it writes capped at max_file_bytes: a disk that fills up."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], cwd=ROOT, capture_output=True, text=True,
                          preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


def test_a_full_disk_during_a_checkpoint_and_during_a_metrics_append_loses_nothing(data_root, tmp_path):
    full = tmp_path / "full"
    run_train(args(data_root, full, "--train.max_steps=12", "--model.dropout=0.1"))
    for case in ("checkpoint", "metrics"):
        out = tmp_path / case
        run_train(args(data_root, out, "--train.max_steps=12", "--model.dropout=0.1", "--train.hard_stop=4"))
        if case == "checkpoint":  # model.pt (6.5 MB) cannot be written; metrics (small) can
            broken = limited_run(args(data_root, out, "--train.max_steps=12", "--model.dropout=0.1",
                                      "--checkpoint.interval=8"), 1_000_000)
            assert "saving the checkpoint of step 8 in" in broken.stderr
            assert "(File too large); step4 is intact: free disk space, then run the same" in broken.stderr
            assert not (out / "step8").exists() and not (out / "step8.partial").exists()  # its space is free
        else:  # room for about two more rows of metrics, cut in the middle of a line
            size = (out / "metrics.jsonl").stat().st_size
            broken = limited_run(args(data_root, out, "--train.max_steps=12", "--model.dropout=0.1",
                                      "--log.metrics_collect_interval=1"), size + 1000)
            assert not (out / "metrics.jsonl").read_text().endswith("\n")  # a partial line was written
        assert broken.returncode != 0 and "Traceback" not in broken.stderr, broken.stderr
        assert broken.stderr.strip().count("\n") == 0 or "warning" in broken.stderr  # one sentence
        assert [s for s, _ in find_checkpoints(out)] == [4]
        resumed = run_train(args(data_root, out, "--train.max_steps=12", "--model.dropout=0.1"))
        assert "at step 4" in resumed.stdout
        assert losses(out) == losses(full), case  # bit-exact, dropout included, no step missing or twice


def test_a_save_that_fails_after_its_folder_is_complete_says_that_step_is_intact(data_root, tmp_path):
    """`latest` cannot be swapped (a folder stands where its link is made): step 4 is whole on disk all the same,
    and the sentence says so rather than name the step before."""
    out = tmp_path / "run"
    common = args(data_root, out, "--train.max_steps=6", "--checkpoint.interval=2")
    run_train([*common, "--train.hard_stop=2"])
    (out / "latest.tmp" / "x").mkdir(parents=True)
    broken = run_train(common, check=False)
    assert_one_sentence(broken, "saving the checkpoint of step 4 in", "step4 is intact all the same")
    (out / "latest.tmp" / "x").rmdir()
    (out / "latest.tmp").rmdir()
    assert "resumed from" in run_train(common).stdout and [s for s, _ in find_checkpoints(out)] == [2, 4, 6]


def test_folders_the_project_did_not_write_are_never_deleted(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=2"))
    (out / "step7").mkdir()  # someone's folder without a marker
    (out / "results.partial").mkdir()
    (out / "step5.partial").mkdir()  # what an interrupted save of ours leaves
    refused = run_train(args(data_root, out, "--train.max_steps=2", "--train.seed=5", "--checkpoint.load=never"),
                        check=False)
    assert refused.returncode != 0 and "already holds another run" in refused.stderr
    assert (out / "step7").exists() and (out / "results.partial").exists() and (out / "step5.partial").exists()
    run_train(args(data_root, out, "--train.max_steps=3"))  # the folder is this run's own: resume
    assert (out / "step7").exists() and (out / "results.partial").exists()
    assert not (out / "step5.partial").exists()


FAILING_SAMPLES = """
import sys
sys.path.insert(0, {root!r})
import train
def broken(*args, **kwargs):
    raise RuntimeError("sampling broke")
import sample
sample.generate_text = broken
train.main({argv!r})
"""


def test_a_failing_sample_loses_no_training(data_root, tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "run_with_broken_samples.py"
    argv = args(data_root, out, "--train.max_steps=6", "--eval.sample_interval=2", "--checkpoint.interval=3")
    script.write_text(FAILING_SAMPLES.format(root=str(ROOT), argv=argv))
    result = warm_python.python([str(script)], ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "writing samples at step 2 failed (RuntimeError: sampling broke); training goes on" in result.stderr
    assert [s for s, _ in find_checkpoints(out)] == [3, 6] and len(read_metrics(out)) == 6


def test_nan_weights_give_the_non_finite_message_before_any_sample(data_root, tmp_path):
    result = run_train(args(data_root, tmp_path / "run", "--train.max_steps=6", "--optim.lr=1e30",
                            "--eval.sample_interval=3", "--log.metrics_collect_interval=100"), check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    # the first non-finite step (2), not the step whose sample found it (3): the collected rows are written first
    assert "train/loss is nan at step 2" in result.stderr and "--- step" not in result.stdout
    assert find_checkpoints(tmp_path / "run") == []


def test_an_unreadable_marker_is_not_a_checkpoint_anywhere(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2", "--checkpoint.keep_last=0"))
    (out / "step2" / "COMPLETE").write_text("{not json")
    listed = subprocess.run(
        [sys.executable, "checkpoint.py", "list", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert listed.returncode == 0 and "Traceback" not in listed.stderr and "unreadable COMPLETE" in listed.stderr
    assert "step4" in listed.stdout and "step2" not in listed.stdout
    run_train(args(data_root, out, "--train.max_steps=8", "--checkpoint.interval=2", "--checkpoint.keep_last=2"))
    assert [s for s, _ in find_checkpoints(out)] == [6, 8]  # retention went on working


def test_preparing_data_again_replaces_the_whole_folder(tmp_path):
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    big.write_text("To be, or not to be, that is the question.\n" * 3000)
    small.write_text("Brevity is the soul of wit.\n" * 50)
    prepare_text(str(tmp_path / "ds"), [str(big)], 2_000, 0.1, workers=1)
    assert len(list((tmp_path / "ds").glob("train_*.npy"))) > 3
    prepare_text(str(tmp_path / "fresh"), [str(small)], 2_000, 0.1, workers=1)
    prepare_text(str(tmp_path / "ds"), [str(small)], 2_000, 0.1, workers=1)
    assert sorted(p.name for p in (tmp_path / "ds").glob("*.npy")) == sorted(
        p.name for p in (tmp_path / "fresh").glob("*.npy")
    )
    assert [p.name for p in tmp_path.iterdir() if ".new-" in p.name] == []


def test_save_overwrite_replaces_another_run_without_losing_it_first(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=4", "--eval.interval=2", "--checkpoint.interval=2"))
    (out / "wandb_id.txt").write_text("oldrun01")
    new_run = args(data_root, out, "--train.max_steps=3", "--train.seed=9", "--checkpoint.save_overwrite=true")
    crashed = run_train(new_run + ["--optim.lr=1e30"], check=False)  # dies before its first checkpoint
    assert crashed.returncode != 0
    assert [s for s, _ in find_checkpoints(out)] == [2, 4]  # the old run's checkpoints are still there
    replaced = run_train(new_run)
    assert "replacing the different run" in replaced.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]  # not a resume of the old run
    assert [s for s, _ in find_checkpoints(out)] == [3]
    assert not (out / "wandb_id.txt").exists() and not (out / "metrics_step2.json").exists()
    assert json.loads((out / "config.json").read_text())["train"]["seed"] == 9
    again = run_train(new_run + ["--train.max_steps=4"])  # save_overwrite still set: its own run resumes
    assert "at step 3" in again.stdout and [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- 8-11: mistakes accepted silently


@pytest.mark.parametrize("override", [
    "--optim.grad_clip=-1", "--train.max_steps=-5", "--checkpoint.interval=-1", "--eval.interval=-1",
    "--optim.warmup_steps=-3", "--train.time_limit=-1", "--optim.lr=-1", "--model.dropout=2", "--optim.beta2=1.5",
    "--eval.num_samples=0", "--eval.sample_top_k=-1", "--train.device=tpu", "--optim.lr=nan"])
def test_out_of_range_values_fail_with_the_fields_name(override):
    key = override[2:].split("=")[0]
    with pytest.raises(ConfigError, match=rf"^{key} must be .*; set it to a value in range\.$"):
        parse_args([override])


def test_a_range_error_from_train_py_is_one_line_and_writes_nothing(tmp_path):
    result = warm_python.python(["train.py", "--train.max_steps=-5", f"--train.out_dir={tmp_path / 'o'}"], ROOT)
    assert result.returncode != 0
    assert result.stderr.strip() == "error: train.max_steps must be at least 1 (got -5); set it to a value in range."
    assert not (tmp_path / "o").exists()


def test_resuming_with_a_changed_identity_is_refused_and_safe_changes_are_recorded(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=2"))
    first_config = (out / "config.json").read_text()
    for change in ("--train.seed=7", "--train.total_batch_size=256", "--model.n_embd=64", "--data.shuffle=false"):
        refused = run_train(args(data_root, out, "--train.max_steps=4", change), check=False)
        key = change[2:].split("=")[0]
        assert refused.returncode != 0 and f"this run has {key}=" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    resumed = run_train(args(data_root, out, "--train.max_steps=4", "--optim.lr=0.001"))
    assert "changed settings: optim.lr 0.005 -> 0.001, train.max_steps 2 -> 4" in resumed.stdout
    assert (out / "config.json").read_text() == first_config  # the first config is kept
    recorded = json.loads((out / "config_changes.jsonl").read_text())
    assert recorded == {"step": 2, "changes": {"optim.lr": [0.005, 0.001], "train.max_steps": [2, 4]}}


@pytest.mark.parametrize("text,message", [
    ("model.n_layer = 2\nmodel.n_head = (\n", r"cfg.py:2: syntax error"),
    ("model.n_layer = 2\nraise ValueError('no')\n", r"cfg.py:2: ValueError: no; fix that line"),
    ("import not_a_module_anywhere\n", r"cfg.py:1: ModuleNotFoundError"),
    ("model = 3\n", r"'model' is a section and cannot be assigned"),
])
def test_a_broken_config_file_is_one_sentence_with_file_and_line(tmp_path, text, message):
    path = tmp_path / "cfg.py"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        parse_args([str(path)])


def test_a_cancel_file_left_by_an_earlier_run_is_removed_not_obeyed(data_root, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "CANCEL").touch()
    result = run_train(args(data_root, out, "--train.max_steps=4"))
    assert "left by an earlier run" in result.stdout
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- 12-14: bad data and arguments


@pytest.mark.parametrize("array,message", [
    (np.full(100, 60000, dtype=np.uint16), "holds token id 60000, beyond the 50257 ids"),
    (np.full(100, 50300, dtype=np.uint16), "holds token id 50300, beyond the 50257 ids"),  # the padded range
    (np.zeros(100, dtype=np.float32), "is a 1-D float32 array"),
    (np.zeros((10, 10), dtype=np.uint16), "is a 2-D uint16 array"),
])
def test_bad_shards_fail_when_opened_naming_the_file(tmp_path, array, message):
    np.save(tmp_path / "train_000001.npy", array)
    with pytest.raises(DataError, match=message) as error:
        TokenLoader(str(tmp_path), "train", batch_size=2, block_size=8)
    assert "train_000001.npy" in str(error.value)


@pytest.mark.parametrize("header", [b"{'descr': '<u2', 'fortran_order': False, 'shape': (100, ",  # tokenize's error
                                    b"{'descr': '<u2', 'fortran_order': False, 'shape': (100,), }\x00"])
def test_a_shard_with_a_damaged_header_is_one_sentence_saying_it_is_no_readable_npy_file(tmp_path, header):
    path = tmp_path / "train_000001.npy"
    np.save(path, np.zeros(100, dtype=np.uint16))
    raw = path.read_bytes()
    length = int.from_bytes(raw[8:10], "little")  # the header's length, after the magic string and the version
    path.write_bytes(raw[:10] + header.ljust(length - 1) + b"\n" + raw[10 + length:])
    with pytest.raises(DataError, match="train_000001.npy is not a readable .npy file .*; prepare the dataset again"):
        TokenLoader(str(tmp_path), "train", batch_size=2, block_size=8)


def test_a_train_shard_that_is_a_named_pipe_is_one_sentence_before_anything_is_written(data_root, tmp_path):
    """Opening a named pipe waits for a writer that never comes: the start would hang forever."""
    import shutil

    shutil.copytree(data_root / "shakespeare", tmp_path / "data" / "shakespeare")
    shard = sorted((tmp_path / "data" / "shakespeare").glob("train_*.npy"))[0]
    shard.unlink()
    os.mkfifo(shard)
    out = tmp_path / "run"
    result = warm_python.python(["train.py", *args(tmp_path / "data", out)], ROOT, timeout=300)
    assert_one_sentence(result, f"train shard {shard} is not a regular file (a named pipe (FIFO))",
                        "put the .npy file prepare_data.py writes in its place")
    assert not out.exists()


def test_a_short_last_shard_does_not_make_the_dataset_unusable(tmp_path):
    write_shard(str(tmp_path / "train_000001.npy"), np.arange(1000) % 50000)
    write_shard(str(tmp_path / "train_000002.npy"), np.arange(5))
    assert TokenLoader(str(tmp_path), "train", batch_size=2, block_size=8).num_sequences == 999 // 8


@pytest.mark.parametrize("name,content,message", [
    ("blob.txt", b"\x00\x01\x02binary", "looks binary"),
    ("latin.txt", "line one\nna\xefve\n".encode("latin-1"), "latin.txt:2 is not valid UTF-8"),
    ("bad.jsonl", b'{"text": "fine"}\n{"text": broken\n', "bad.jsonl:2 is not a JSON object"),
    ("notext.jsonl", b'{"body": "no text field"}\n', 'notext.jsonl:1 has no "text" string field'),
    ("empty.txt", b"", "holds no text"),
])
def test_bad_text_inputs_are_one_sentence_naming_file_and_line(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    result = warm_python.python(["prepare_data.py", "text", str(tmp_path / name), "--out_dir", str(tmp_path / "out")],
                                ROOT)
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("line", [
    {"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 4},
    {"ctx": "A man", "endings": ["a", "b", "c"], "label": 0},
])
def test_hellaswag_examples_out_of_shape_are_one_sentence(tmp_path, line):
    import hellaswag_eval

    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(hellaswag_eval.TaskDataError, match="line 1 of .* exactly four endings and a label 0-3"):
        hellaswag_eval.load_examples(str(path))


@pytest.mark.parametrize("command,message", [
    (["hellaswag_eval.py", "--init_from=gpt2", "--batch_size=0"], "--batch_size must be at least 1"),
    (["sample.py", "--init_from=nowhere", "--top_p=2"], "--top_p=2.0 is out of range"),
    (["sample.py", "--init_from=nowhere", "--num_samples=0"], "--num_samples=0 is out of range"),
    (["sample.py", "--init_from=/no/such/run"], "is not a folder nor one of gpt2"),
    (["checkpoint.py", "export-hf", "/no/such/run"], "the following arguments are required: out_dir"),
    (["checkpoint.py", "list", "/no/such/run"], "is not a folder; give the train.out_dir"),
])
def test_command_line_mistakes_are_one_sentence(command, message):
    result = warm_python.python(command, ROOT)
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- 15


def test_the_tied_embedding_is_saved_once_and_old_checkpoints_still_load(data_root, tmp_path):
    from checkpoint import load_model

    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=1", "--optim.warmup_steps=1"))
    state = torch.load(out / "step1" / "model.pt", weights_only=True)
    assert "lm_head.weight" not in state
    embedding_bytes = 50304 * 32 * 4
    assert (out / "step1" / "model.pt").stat().st_size < 1.1 * embedding_bytes
    model = load_model(str(out), "cpu", "--init_from")
    old_style = {**state, "lm_head.weight": state["transformer.wte.weight"].clone()}  # as older checkpoints were
    torch.save(old_style, out / "step1" / "model.pt")
    (out / "step1" / "COMPLETE").write_text(json.dumps({"step": 1, "kind": "permanent", "files": {}}))
    reloaded = load_model(str(out / "step1"), "cpu", "--init_from")
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()  # still tied
