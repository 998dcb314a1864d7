"""The bucket is a run folder too (checkpoint.remote_folder on moto's S3 server on 127.0.0.1): another run there is
refused before anything is written and save_overwrite replaces it whole; a remote folder that is out_dir is refused;
a slow store loses no upload to local retention; damaged checkpoints, rewinds and fine-tunes from the bucket; and
the start's other refusals and messages, each one sentence."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, TINY, assert_one_sentence, read_metrics, run_in_process, run_train

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from lab import remote  # noqa: E402
from bucket_fixture import bucket_steps, s3  # noqa: E402,F401 - s3 is a fixture
from checkpoint import find_checkpoints  # noqa: E402


def args(data_root, out, *extra):
    return TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0",
                   "--eval.sample_interval=0", *extra]


def bucket_listing(url):
    """Every object in the bucket folder and its size: what a refused command must leave as it was."""
    fs, root = remote.filesystem(url)
    fs.invalidate_cache()
    return {path: info["size"] for path, info in fs.find(root, detail=True).items()}


def test_another_run_in_the_bucket_is_refused_and_save_overwrite_replaces_it_whole(s3, data_root, tmp_path):
    url = "s3://runs/shared"
    common = ["--train.max_steps=8", "--checkpoint.interval=2", f"--checkpoint.remote_folder={url}"]
    run_train(args(data_root, tmp_path / "a", *common))  # run A: steps 2..8, keep_last=3
    assert bucket_steps(url) == [4, 6, 8]
    before = bucket_listing(url)
    for extra in ([], ["--checkpoint.load=never"]):  # run B (another seed) into a new, empty out_dir
        refused = run_train(args(data_root, tmp_path / "b", *common, "--train.seed=7", *extra), check=False)
        assert_one_sentence(refused, f"checkpoint.remote_folder={url} holds another run", "train.seed=1337 there",
                            "--checkpoint.save_overwrite=true")
        assert bucket_listing(url) == before and not (tmp_path / "b").exists()
    # A fresh start of the same run over its own checkpoints would mix two runs there too.
    refused = run_train(args(data_root, tmp_path / "c", *common, "--checkpoint.load=never"), check=False)
    assert_one_sentence(refused, "holds checkpoints (steps 4, 6, 8) and this run starts afresh")
    assert bucket_listing(url) == before
    # save_overwrite: B replaces A in the bucket, whole, once its first checkpoint is up, A's record included.
    fs, root = remote.filesystem(url)
    fs.pipe_file(f"{root}/metrics_step8.json", b"{}")  # A's evaluation at step 8 (this test's runs evaluate nothing)
    replaced = run_train(args(data_root, tmp_path / "b", *common, "--train.seed=7", "--train.hard_stop=2",
                              "--checkpoint.save_overwrite=true"))
    assert f"replacing the run in {url}" in replaced.stdout
    assert bucket_steps(url) == [2]  # A's 4, 6 and 8 are gone, none of B's went to A's retention
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/metrics_step8.json")
    assert json.loads(fs.cat_file(f"{root}/config.json"))["train"]["seed"] == 7
    fresh = run_train(args(data_root, tmp_path / "fresh", *common, "--train.seed=7"))  # a fresh node resumes B
    assert "downloaded step2" in fresh.stdout and bucket_steps(url) == [4, 6, 8]


@pytest.mark.parametrize("where", ["out_dir", "inside out_dir"])
def test_a_remote_folder_that_is_the_run_folder_is_refused(data_root, tmp_path, where):
    out = tmp_path / "run"
    folder = out if where == "out_dir" else out / "bucket"
    result = run_train(args(data_root, out, "--train.max_steps=2", f"--checkpoint.remote_folder=file://{folder}"),
                       check=False)
    assert_one_sentence(result, "is train.out_dir", "give a remote folder outside")
    assert not out.exists()


def test_a_slow_store_loses_no_upload_to_local_retention_and_reports_its_lag(s3, data_root, tmp_path, monkeypatch):
    """A throttled client (every object takes 0.2 s to upload) with an ephemeral checkpoint every step and async
    saves: local retention waits for the uploads, uploads a newer checkpoint supersedes are skipped, no upload
    fails, and the bucket always ends with the run's last checkpoint."""
    url = "s3://runs/slow"
    put = remote.Uploader._checkpoint

    def slowly(self, step, folder):
        original = self.fs.put_file
        self.fs.put_file = lambda *a, **k: (time.sleep(0.2), original(*a, **k))[1]
        try:
            put(self, step, folder)
        finally:
            self.fs.put_file = original

    monkeypatch.setattr(remote.Uploader, "_checkpoint", slowly)
    out = tmp_path / "run"
    result = run_train(args(data_root, out, "--train.max_steps=8", "--checkpoint.interval=4",
                            "--checkpoint.ephemeral_interval=1", "--checkpoint.keep_last=1",
                            "--checkpoint.async_save=true", "--log.metrics_collect_interval=1",
                            f"--checkpoint.remote_folder={url}"))
    assert "failed" not in result.stderr, result.stderr
    assert bucket_steps(url) == [8] and [s for s, _ in find_checkpoints(out)] == [8]
    rows = read_metrics(out)
    assert all(r["checkpoint/upload_failures"] == 0 for r in rows)
    assert max(r["checkpoint/upload_lag_sec"] for r in rows) > 0.2  # the lag was there, and measured


@pytest.mark.parametrize("damage", ["a listed file is missing", "an empty marker", "a list for a marker"])
def test_a_damaged_bucket_checkpoint_falls_back_or_is_one_sentence_and_leaves_nothing(s3, data_root, tmp_path,
                                                                                      damage):
    url = f"s3://runs/damaged-{damage.split()[1]}"
    run_train(args(data_root, tmp_path / "run", "--train.max_steps=4", "--checkpoint.interval=2",
                   f"--checkpoint.remote_folder={url}"))
    fs, root = remote.filesystem(url)
    if damage == "a listed file is missing":
        fs.rm_file(f"{root}/step4/optim.pt")
    else:
        fs.pipe_file(f"{root}/step4/COMPLETE", b"{}" if damage == "an empty marker" else b"[1, 2]")
    result = run_train(args(data_root, tmp_path / "tuned", "--train.max_steps=6",
                            f"--checkpoint.load_path={url}/step4"), check=False,
                       env={"NANOGPT_REMOTE_CACHE": str(tmp_path / "cache")})
    assert_one_sentence(result, f"{url}/step4")
    assert not any("partial" in name for _, names, _ in os.walk(tmp_path / "cache") for name in names)
    fresh = tmp_path / "fresh"
    resumed = run_train(args(data_root, fresh, "--train.max_steps=4", "--checkpoint.interval=2",
                             f"--checkpoint.remote_folder={url}"))
    assert "downloaded step2" in resumed.stdout  # the damaged step4 passed over, with a warning if it looked whole
    assert not [name for name in os.listdir(fresh) if "download" in name]
    if damage == "a listed file is missing":
        assert "optim.pt is listed in its marker but missing" in resumed.stderr


def test_a_rewind_to_a_step_whose_newer_checkpoints_are_only_in_the_bucket(s3, data_root, tmp_path):
    url = "s3://runs/rewind-bucket"
    out = tmp_path / "run"
    common = ["--checkpoint.interval=2", "--checkpoint.keep_last=0", f"--checkpoint.remote_folder={url}"]
    run_train(args(data_root, out, "--train.max_steps=6", *common))
    for step in (4, 6):  # out_dir lost them (another node's disk); the bucket has them
        os.rename(out / f"step{step}", tmp_path / f"kept{step}")
    os.remove(out / "latest")
    rewound = run_train(args(data_root, out, "--train.max_steps=6", "--checkpoint.resume_step=2", *common))
    assert "resumed from" in rewound.stdout and "at step 2" in rewound.stdout
    fs, root = remote.filesystem(url)
    (aside,) = fs.ls(f"{root}/rewound", detail=False)
    assert fs.exists(f"{aside}/step6/COMPLETE")  # the bucket's newer steps were moved aside, not used
    assert bucket_steps(url) == [2, 4, 6] and [s for s, _ in find_checkpoints(out)] == [2, 4, 6]  # trained again


def test_a_fine_tune_whose_source_is_gone_resumes_on_a_fresh_node_from_its_bucket(s3, data_root, tmp_path):
    url = "s3://runs/fine-tune"
    source = tmp_path / "source"
    run_train(args(data_root, source, "--train.max_steps=2"))
    common = ["--train.max_steps=4", "--checkpoint.interval=2", f"--checkpoint.remote_folder={url}",
              f"--checkpoint.load_path={source}", "--checkpoint.load_trainer_state=false"]
    run_train(args(data_root, tmp_path / "first", *common, "--train.hard_stop=2"))
    os.rename(source, tmp_path / "gone")
    fresh = run_train(args(data_root, tmp_path / "fresh", *common))
    assert "downloaded step2" in fresh.stdout and bucket_steps(url) == [2, 4]


def test_a_kill_during_a_download_leaves_nothing_that_looks_whole_and_the_next_start_downloads_again(
        s3, data_root, tmp_path):
    url = "s3://runs/kill-download"
    run_train(args(data_root, tmp_path / "run", "--train.max_steps=2", f"--checkpoint.remote_folder={url}"))
    fresh = tmp_path / "fresh"
    # a store slow enough to be killed in the middle of a download
    script = ("import sys, time, train\nfrom lab import remote\n"
              "def slow(*args, **kwargs):\n"
              "    print('downloading', flush=True)\n"
              "    time.sleep(60)\n"
              "remote.download = slow\n"
              "train.main(sys.argv[1:])\n")
    process = subprocess.Popen([sys.executable, "-c", script, *args(data_root, fresh, "--train.max_steps=4",
                                                                    f"--checkpoint.remote_folder={url}")],
                               cwd=ROOT, env={**os.environ, **s3, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "downloading"
    os.makedirs(fresh / "step2.download.partial", exist_ok=True)  # what a kill in the middle leaves
    (fresh / "step2.download.partial" / "model.pt").write_bytes(b"half")
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = run_train(args(data_root, fresh, "--train.max_steps=4", f"--checkpoint.remote_folder={url}"))
    assert "downloaded step2" in resumed.stdout
    assert sorted(name for name in os.listdir(fresh) if name.startswith("step")) == ["step2", "step4"]


@pytest.mark.parametrize("setting, value, sentence", [
    ("model_type", "gpt_neo", "holds a gpt_neo model, not a GPT-2"),
    ("activation_function", "relu", "activation_function='relu', which model.py does not compute"),
    ("layer_norm_epsilon", 1e-6, "layer_norm_epsilon=1e-06, which model.py does not compute"),
])
def test_a_hugging_face_folder_model_py_cannot_compute_is_refused(data_root, tmp_path, setting, value, sentence):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf"
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, setting: value}))
    result = run_train(args(data_root, tmp_path / "run", f"--checkpoint.load_path={folder}",
                            "--model.n_layer=12", "--model.n_head=12", "--model.n_embd=768",
                            "--model.block_size=1024"), check=False)
    assert_one_sentence(result, sentence)
    assert not (tmp_path / "run").exists()


def test_a_resume_on_other_data_under_the_same_name_is_refused(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=4", "--train.hard_stop=2"))
    other = tmp_path / "other" / "shakespeare"  # essays, under the name of the plays
    other.mkdir(parents=True)
    for name in os.listdir(data_root / "shakespeare"):
        np.save(other / name, np.random.default_rng(0).integers(0, 50000, size=20000).astype(np.uint16))
    listed = sorted(os.listdir(out))
    result = run_train(args(tmp_path / "other", out, "--train.max_steps=4"), check=False)
    assert_one_sentence(result, "the dataset shakespeare under data.data_root", "is not the one this run trained on")
    assert sorted(os.listdir(out)) == listed


def test_a_load_path_at_the_end_of_this_run_is_refused_before_anything_is_written(data_root, tmp_path):
    run_train(args(data_root, tmp_path / "source", "--train.max_steps=4"))
    result = run_train(args(data_root, tmp_path / "run", "--train.max_steps=4",
                            f"--checkpoint.load_path={tmp_path / 'source'}"), check=False)
    assert_one_sentence(result, "is at step 4, and this run ends at step 4", "--checkpoint.load_trainer_state=false")
    assert not (tmp_path / "run").exists()


def test_a_model_file_that_ignores_its_config_is_refused_and_one_file_is_one_module(data_root, tmp_path):
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text("import dataclasses, model\n"
                        "class GPT(model.GPT):\n"
                        "    def __init__(self, config, loss_path='chunked'):\n"
                        "        super().__init__(dataclasses.replace(config, n_layer=1), loss_path)\n")
    result = run_train(args(data_root, tmp_path / "run", "--train.max_steps=2", f"--train.model_module={stubborn}"),
                       check=False)
    assert_one_sentence(result, "was built from a config other than the run's model section (model.n_layer=2, it "
                                "built 1)")
    own = ROOT / "tests" / "gpt_of_your_own.py"
    run_train(args(data_root, tmp_path / "mine", "--train.max_steps=4", "--train.hard_stop=2",
                   f"--train.model_module={own}"))
    resumed = run_train(args(data_root, tmp_path / "mine", "--train.max_steps=4",
                             f"--train.model_module={os.path.relpath(own, ROOT)}"))  # the same file, relative
    assert "resumed from" in resumed.stdout


def test_messages_name_the_right_thing(data_root, tmp_path, s3):
    plain = run_train(args(data_root, tmp_path / "a", "--checkpoint.remote_folder=/shared/runs/a"), check=False)
    assert_one_sentence(plain, "checkpoint.remote_folder=/shared/runs/a is not a URL")
    missing = run_train(args(data_root, tmp_path / "b", "--checkpoint.load_path=s3://no-such-bucket/run"),
                        check=False)
    assert_one_sentence(missing, "checkpoint.load_path=s3://no-such-bucket/run")
    assert "holds no complete checkpoint" not in missing.stderr
    a_file = tmp_path / "data_root_is_a_file"
    a_file.write_text("")
    assert_one_sentence(run_train(args(a_file, tmp_path / "c"), check=False), "is a file, not a folder")
    import checkpoint
    export = run_in_process(["export-hf", str(tmp_path / "nothing"), str(tmp_path / "hf")], checkpoint.main)
    assert_one_sentence(export, "export-hf's CHECKPOINT=")


@pytest.mark.parametrize("content", ["[1, 2]\n", "random", "folder", ""])
def test_plotting_a_metrics_file_that_is_no_such_file_is_one_sentence(tmp_path, content):
    from tools import plot_metrics
    run = tmp_path / "run"
    run.mkdir()
    if content == "folder":
        (run / "metrics.jsonl").mkdir()
    elif content == "random":
        (run / "metrics.jsonl").write_bytes(bytes(range(128, 256)) * 4)
    else:
        (run / "metrics.jsonl").write_text(content)
    assert_one_sentence(run_in_process([str(run)], plot_metrics.main))


def test_a_checkpoints_time_is_in_its_own_steps_row_the_last_one_included(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2"))
    rows = {r["step"]: r for r in read_metrics(out)}
    assert set(rows) == {1, 2, 3, 4}  # a late row of a step is merged into its row
    assert [s for s in rows if "throughput/checkpoint_time_sec" in rows[s]] == [2, 4]


def test_the_whole_run_folder_is_in_the_bucket(s3, data_root, tmp_path):
    """OLMo-core's persist_working_file: what the run folder keeps besides checkpoints goes up with them."""
    url = "s3://runs/whole"
    out = tmp_path / "run"
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=4",
                      "--eval.interval=2", "--eval.sample_interval=4", "--eval.sample_tokens=4",
                      "--checkpoint.interval=2", f"--checkpoint.remote_folder={url}"])
    fs, root = remote.filesystem(url)
    fs.invalidate_cache()
    in_bucket = {path.rsplit("/", 1)[-1] for path in fs.ls(root, detail=False)}
    assert {"config.json", "metrics.jsonl", "metrics_step2.json", "metrics_step4.json", "samples.txt",
            "environment.json", "step2", "step4"} <= in_bucket
    assert fs.cat_file(f"{root}/samples.txt").decode() == (out / "samples.txt").read_text()
