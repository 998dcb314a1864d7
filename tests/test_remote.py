"""checkpoint.remote_folder against a real S3 endpoint on 127.0.0.1 (moto's server, as s3fs's own tests use):
uploads with COMPLETE last, a resume into an empty out_dir, retention and rewinds in the bucket, an endpoint
that goes away mid-run, and the mistakes a user can make, each one sentence before step 1."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TINY, assert_one_sentence, read_metrics, run_train

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from lab import remote  # noqa: E402
from bucket_fixture import bucket_steps, free_port, s3  # noqa: E402,F401 - s3 is a fixture
from checkpoint import find_checkpoints  # noqa: E402

def args(data_root, out, *extra):
    return TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0",
                   "--eval.sample_interval=0", *extra]


def test_a_run_uploads_and_a_fresh_node_resumes_from_the_bucket_bit_exactly(s3, data_root, tmp_path):
    url = "s3://runs/resume"
    whole = tmp_path / "whole"
    run_train(args(data_root, whole, "--train.max_steps=6", "--checkpoint.interval=3"))
    first = tmp_path / "first"
    run_train(args(data_root, first, "--train.max_steps=6", "--checkpoint.interval=3", "--train.hard_stop=3",
                   f"--checkpoint.remote_folder={url}"))
    assert bucket_steps(url) == [3]
    fs, root = remote.filesystem(url)
    assert fs.exists(f"{root}/config.json") and fs.exists(f"{root}/metrics.jsonl")
    # A fresh node: an empty out_dir, the same command.
    fresh = tmp_path / "fresh"
    resumed = run_train(args(data_root, fresh, "--train.max_steps=6", "--checkpoint.interval=3",
                             f"--checkpoint.remote_folder={url}"))
    assert f"downloaded step3 from {url}" in resumed.stdout and "resumed from" in resumed.stdout
    assert [r["train/loss"] for r in read_metrics(fresh)] == [r["train/loss"] for r in read_metrics(whole)]
    assert bucket_steps(url) == [3, 6]
    ours = torch.load(fresh / "step6" / "model.pt", weights_only=True)
    theirs = torch.load(whole / "step6" / "model.pt", weights_only=True)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_checkpoint_without_its_complete_marker_in_the_bucket_is_never_used(s3, tmp_path):
    url = "s3://runs/partial"
    fs, root = remote.filesystem(url)
    fs.pipe_file(f"{root}/step9/model.pt", b"half an upload")  # a kill -9 before COMPLETE went up
    assert remote.newest_complete(url) is None
    local = tmp_path / "ckpt"
    local.mkdir()
    (local / "model.pt").write_bytes(b"weights")
    (local / "COMPLETE").write_text('{"step": 4, "kind": "permanent", "files": {"model.pt": "%s"}}'
                                    % remote.sha256_bytes(b"weights"))
    os.rename(local, tmp_path / "step4")
    uploader = remote.Uploader(url, keep_last=0)
    uploader.upload_checkpoint(str(tmp_path / "step4"), 4, "permanent")
    uploader.close()
    assert remote.newest_complete(url) == 4  # step9 has files but no marker: skipped
    got = remote.download(url, 4, str(tmp_path / "back"))
    assert (tmp_path / "back" / "model.pt").read_bytes() == b"weights" and got == str(tmp_path / "back")


def test_killed_during_an_upload_the_resume_skips_the_incomplete_remote_checkpoint(s3, data_root, tmp_path):
    url = "s3://runs/killed"
    out = tmp_path / "run"
    common = args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2", f"--checkpoint.remote_folder={url}")
    run_train(common + ["--train.hard_stop=2"])
    # The upload of step4 was killed before its COMPLETE: its files are there, its marker is not.
    fs, root = remote.filesystem(url)
    for name in ("model.pt", "optim.pt"):
        fs.put_file(str(out / "step2" / name), f"{root}/step4/{name}")
    assert bucket_steps(url) == [2]
    fresh = tmp_path / "fresh"
    resumed = run_train(args(data_root, fresh, "--train.max_steps=4", "--checkpoint.interval=2",
                             f"--checkpoint.remote_folder={url}"))
    assert "downloaded step2" in resumed.stdout and [s for s, _ in find_checkpoints(fresh)] == [2, 4]
    assert bucket_steps(url) == [2, 4]


def test_a_real_kill_during_an_upload_leaves_the_bucket_usable(s3, data_root, tmp_path):
    """kill -9 of the training process while uploads run: whatever reached the bucket, what a resume uses is
    complete."""
    url = "s3://runs/kill9"
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "train.py"), *args(data_root, out, "--train.max_steps=200",
                                                             "--checkpoint.interval=1", "--checkpoint.keep_last=0",
                                                             f"--checkpoint.remote_folder={url}")]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **s3, "OMP_NUM_THREADS": "1"},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(bucket_steps(url)) < 3:
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    steps = bucket_steps(url)
    assert len(steps) >= 3
    fresh = tmp_path / "fresh"
    resumed = run_train(args(data_root, fresh, f"--train.max_steps={steps[-1] + 1}", "--checkpoint.interval=1",
                             f"--checkpoint.remote_folder={url}"))
    assert f"downloaded step{steps[-1]}" in resumed.stdout


def test_retention_and_rewind_apply_to_the_bucket_and_delete_nothing_a_rewind_moves(s3, data_root, tmp_path):
    url = "s3://runs/retention"
    out = tmp_path / "run"
    common = args(data_root, out, "--train.max_steps=6", "--checkpoint.interval=1", "--checkpoint.keep_last=2",
                  "--checkpoint.fixed_steps=1", f"--checkpoint.remote_folder={url}")
    run_train(common)
    assert bucket_steps(url) == [s for s, _ in find_checkpoints(out)] == [1, 5, 6]
    run_train(common + ["--checkpoint.resume_step=5", "--train.max_steps=5"])
    assert bucket_steps(url) == [1, 5]
    fs, root = remote.filesystem(url)
    (aside,) = fs.ls(f"{root}/rewound", detail=False)
    assert fs.exists(f"{aside}/step6/COMPLETE") and fs.exists(f"{aside}/step6/model.pt")


def test_when_the_endpoint_goes_away_training_goes_on_and_the_failure_is_reported(s3, data_root, tmp_path,
                                                                                  monkeypatch):
    import s3fs
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("gone")
    original = remote.read_run  # the endpoint goes away once the start has read the bucket

    def read_then_stop(url):
        found = original(url)
        server.stop()
        return found

    monkeypatch.setattr(remote, "read_run", read_then_stop)
    monkeypatch.setattr(remote, "RETRIES", (0.0, 0.0))
    import checkpoint
    save = checkpoint.Checkpointer.save

    def save_then_wait_for_uploads(self, *args):  # each upload done before the next step: a deterministic count
        stalled = save(self, *args)
        self.wait()
        if self.uploader:
            self.uploader.wait_idle()
        return stalled

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_then_wait_for_uploads)
    out = tmp_path / "run"
    result = run_train(args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2",
                            "--log.metrics_collect_interval=1", "--checkpoint.remote_folder=s3://gone/run"))
    s3fs.S3FileSystem.clear_instance_cache()
    assert [s for s, _ in find_checkpoints(out)] == [2, 4]  # the run finished, its checkpoints local
    assert "uploading checkpoint step2 to s3://gone/run failed 3 times" in result.stderr
    failures = [r["checkpoint/upload_failures"] for r in read_metrics(out) if "checkpoint/upload_failures" in r]
    # Step 2's upload failed after its row (counted in step 3's); step 4's after the last row, which a late row of
    # step 4 completes once the uploads have ended (it used to be counted nowhere).
    assert failures == [0, 0, 1, 2]
    assert "uploading checkpoint step4 to s3://gone/run failed 3 times" in result.stderr


@pytest.mark.parametrize("case", ["wrong credentials", "no bucket", "no endpoint", "no package"])
def test_a_remote_folder_that_cannot_be_used_is_one_sentence_before_anything_is_written(s3, data_root, tmp_path,
                                                                                        case):
    url, env = "s3://runs/mistake", {**s3}
    if case == "wrong credentials":  # a second server that checks signatures: every key is unknown to it
        port = free_port()
        checking = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                    env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120  # a condition, not a time: the server answers (a busy machine is slow)
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and checking.poll() is None, "moto's server did not start"
                time.sleep(0.1)
    elif case == "no bucket":
        url = "s3://no-such-bucket/run"
    elif case == "no endpoint":  # a port this test holds and never listens on: refused every time, taken by no one
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{closed.getsockname()[1]}"
    else:
        url = "gs://bucket/run"  # gcsfs is not installed here
    out = tmp_path / "run"
    try:
        result = run_train(args(data_root, out, f"--checkpoint.remote_folder={url}"), check=False, env=env)
    finally:
        if case == "wrong credentials":
            checking.terminate()
            checking.wait()
        if case == "no endpoint":
            closed.close()
    assert result.returncode == 1 and "Traceback" not in result.stderr
    expected = {"wrong credentials": "the credentials were refused", "no bucket": "the bucket does not exist",
                "no endpoint": "the endpoint cannot be reached", "no package": "pip install gcsfs"}[case]
    assert expected in result.stderr
    assert_one_sentence(result)
    assert not out.exists()


def test_two_ranks_resume_from_the_bucket_into_an_empty_out_dir_bit_exactly(s3, data_root, tmp_path):
    url = "s3://runs/two-ranks"
    common = ["--train.max_steps=4", "--checkpoint.interval=2", "--train.total_batch_size=256"]
    first = tmp_path / "first"
    run_train(args(data_root, first, *common, "--train.hard_stop=2", f"--checkpoint.remote_folder={url}"),
              nproc=2, env=s3)
    fresh = tmp_path / "fresh"
    resumed = run_train(args(data_root, fresh, *common, f"--checkpoint.remote_folder={url}"), nproc=2, env=s3)
    assert "downloaded step2" in resumed.stdout
    # Bit for bit: the bucket's step2 is the first run's, and the resumed steps are what that run would train
    # on one rank with 2 micro-steps (equal to float tolerance, as tests/test_train.py shows for 2 ranks).
    assert torch.load(fresh / "step2" / "model.pt", weights_only=True).keys() == \
        torch.load(first / "step2" / "model.pt", weights_only=True).keys()
    assert all(torch.equal(a, b) for a, b in zip(torch.load(fresh / "step2" / "model.pt", weights_only=True).values(),
                                                  torch.load(first / "step2" / "model.pt", weights_only=True).values()))
    one = tmp_path / "one"
    run_train(args(data_root, one, *common))
    assert [r["train/loss"] for r in read_metrics(fresh)] == pytest.approx(
        [r["train/loss"] for r in read_metrics(one)], rel=1e-5)
    assert bucket_steps(url) == [2, 4]


def test_load_path_and_init_from_take_a_bucket_url(s3, data_root, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOGPT_REMOTE_CACHE", str(tmp_path / "cache"))
    url = "s3://runs/source"
    source = tmp_path / "source"
    run_train(args(data_root, source, "--train.max_steps=2", "--checkpoint.interval=2",
                   f"--checkpoint.remote_folder={url}"))
    import checkpoint
    ours = checkpoint.load_model(url, "cpu", "--init_from")  # sample.py's and hellaswag_eval.py's --init_from
    theirs = checkpoint.load_model(str(source), "cpu", "--init_from")
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    tuned = run_train(args(data_root, tmp_path / "tuned", "--train.max_steps=3", f"--checkpoint.load_path={url}/step2"))
    assert "loaded weights, optimizer state, trainer state from" in tuned.stdout  # not a resume of its own run
    assert str(tmp_path / "cache") in tuned.stdout


def test_a_bucket_checkpoint_replaced_at_the_same_url_is_downloaded_again(s3, data_root, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOGPT_REMOTE_CACHE", str(tmp_path / "cache"))
    import checkpoint
    url = "s3://runs/replaced"
    common = ["--train.max_steps=2", "--checkpoint.interval=2", f"--checkpoint.remote_folder={url}"]
    run_train(args(data_root, tmp_path / "first", *common))
    first = checkpoint.load_model(f"{url}/step2", "cpu", "--init_from").state_dict()  # now in the cache
    run_train(args(data_root, tmp_path / "second", *common, "--train.seed=7", "--checkpoint.save_overwrite=true"))
    second = checkpoint.load_model(f"{url}/step2", "cpu", "--init_from").state_dict()
    local = checkpoint.load_model(str(tmp_path / "second"), "cpu", "--init_from").state_dict()
    assert all(torch.equal(second[name], local[name]) for name in local)  # the new run's step2, not the cached one
    assert not torch.equal(first["transformer.wte.weight"], second["transformer.wte.weight"])


def test_an_unreachable_endpoint_is_not_called_refused_credentials_whatever_the_probes_name():
    """The probe's name is random hex: one holding "403" was once read as an HTTP 403 (a flaky CI failure)."""
    unreachable = ConnectionError('Could not connect to the endpoint URL: "http://127.0.0.1:9/r/.write_check_4033a81"')
    assert remote.describe_failure(unreachable).startswith("the endpoint cannot be reached")
    assert remote.describe_failure(PermissionError("An error occurred (403) when calling the PutObject operation")) \
        .startswith("the credentials were refused")


def test_save_overwrite_replaces_the_folders_run_in_the_bucket_too_when_an_identity_setting_changes(
        s3, data_root, tmp_path):
    """The README's way to replace a run (--checkpoint.load=never --checkpoint.save_overwrite=true), here with
    another seed, in a folder whose run the bucket holds: the run is replaced in both, as in the folder alone."""
    url = "s3://runs/overwrite"
    out = tmp_path / "run"
    common = ["--train.max_steps=2", "--checkpoint.interval=2", f"--checkpoint.remote_folder={url}"]
    run_train(args(data_root, out, *common))
    replaced = run_train(args(data_root, out, *common, "--train.seed=7", "--checkpoint.load=never",
                              "--checkpoint.save_overwrite=true"))
    assert f"replacing the run in {url}" in replaced.stdout
    fs, root = remote.filesystem(url)
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(f"{root}/config.json"))["train"]["seed"] == 7
    assert json.loads((out / "config.json").read_text())["train"]["seed"] == 7
    assert bucket_steps(url) == [2]  # the new run's step 2, file for file
    assert json.loads(fs.cat_file(f"{root}/step2/COMPLETE")) == json.loads((out / "step2" / "COMPLETE").read_text())
