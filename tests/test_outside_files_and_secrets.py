"""Files from outside are data, never code; secrets reach no record; and what each refusal says, as a user
who tries to break the trainer meets it. The slow parts (a real 2-rank sharded checkpoint) are in
tests/test_fsdp.py, which makes one for its module; these run in this process, on tiny runs."""

import dataclasses
import io
import os
import pickle
import sys
from types import SimpleNamespace

import pytest
import torch

from bucket_fixture import s3  # noqa: F401 - a fixture: moto's S3 server on 127.0.0.1
from conftest import TINY, run_in_process


class RunsCode:
    """Unpickled, it would touch the file it names."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_dcp_values_are_read_without_running_code(tmp_path):
    """DCP reads a sharded checkpoint's non-tensor values (the optimizer's lr, betas, names) with torch.load; the
    trainer's planner reads them as weights_only, so a piece file cannot run code either."""
    from lab.fsdp import Planner

    planner = Planner(flatten_state_dict=False)
    planner.state_dict = {}
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="optim.param_groups.0.lr"))
    crafted = io.BytesIO()
    torch.save(RunsCode(tmp_path / "ran"), crafted)
    crafted.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, crafted)
    assert not (tmp_path / "ran").exists()
    value = io.BytesIO()
    torch.save((0.9, 0.95), value)
    value.seek(0)
    planner.load_bytes(item, value)
    assert planner.state_dict["optim.param_groups.0.lr"] == (0.9, 0.95)


def test_the_metadata_reader_builds_only_dcp_classes(tmp_path):
    from lab.fsdp import MetadataRefused, read_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsCode(tmp_path / "ran")))
    with pytest.raises(MetadataRefused, match="asks to run posix.system"):
        read_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(MetadataRefused, match="holds a dict, not DCP's Metadata"):
        read_metadata(tmp_path)
    assert not (tmp_path / "ran").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process
@pytest.mark.parametrize("linked", ["sharded/__0_0.distcp", "sharded/.metadata", "sharded"])
def test_a_piece_of_a_sharded_checkpoint_that_is_a_link_is_refused_before_it_is_loaded(tmp_path, linked):
    """A link to anywhere, even to a copy of the very file (its checksum passes): the checkpoint's own files only."""
    import hashlib
    import json
    import shutil

    import torch.distributed.checkpoint as dcp

    from checkpoint import UntrustedCheckpoint, verify_checkpoint

    step = tmp_path / "run" / "step2"
    dcp.save({"model.w": torch.arange(4.0)}, checkpoint_id=str(step / "sharded"))
    files = {f"sharded/{p.name}": hashlib.sha256(p.read_bytes()).hexdigest() for p in (step / "sharded").iterdir()}
    (step / "COMPLETE").write_text(json.dumps({"files": files}))
    verify_checkpoint(str(step))  # the checkpoint as saved
    elsewhere = tmp_path / "elsewhere"
    shutil.move(step / linked, elsewhere)
    (step / linked).symlink_to(elsewhere)
    with pytest.raises(UntrustedCheckpoint, match=f"step2/{linked} is a link \\(to {elsewhere}\\), and a checkpoint "
                                                  "is read only from its own files, so it is not loaded: put"):
        verify_checkpoint(str(step))


# ----------------------------------------------------------------------------- secrets reach no record


def every_file_holding(root, secret):
    """The files under `root` whose bytes hold `secret` (checkpoints, W&B's binary log and debug logs included)."""
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and secret.encode() in open(path, "rb").read():
                found.append(path)
    return found


def test_the_webhook_url_reaches_no_file_bucket_or_wandb_record(s3, data_root, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import json

    from lab import remote
    import train
    from checkpoint import read_trainer_state

    out, url = tmp_path / "run", "s3://runs/secret"
    first, second = "http://127.0.0.1:9/services/T0/B0/first-secret-token", "https://127.0.0.1:9/second-secret-token"
    common = [*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    runs = [[*common, "--train.max_steps=2", "--log.wandb=true", f"--checkpoint.remote_folder={url}",
             f"--log.slack_webhook={first}"],
            [*common, "--train.max_steps=3", f"--log.slack_webhook={second}"]]  # a resume with a new URL
    for args in runs:
        monkeypatch.setattr(sys, "argv", ["train.py", *args])  # environment.json and W&B record the command line
        result = run_in_process(args, train.main)
        assert result.returncode == 0, result.stderr
    assert "resumed from" in result.stdout and "slack_webhook" not in result.stdout  # no "changed setting"
    assert (out / "wandb").is_dir() and (out / "step3" / "trainer.pt").exists()
    fs, root = remote.filesystem(url)
    fs.invalidate_cache()
    fs.get(root, str(tmp_path / "bucket"), recursive=True)
    assert (tmp_path / "bucket" / "config.json").exists()
    for secret in ("first-secret-token", "second-secret-token"):
        for place in (out, tmp_path / "bucket"):
            assert every_file_holding(place, secret) == []
    config = json.loads((out / "config.json").read_text())
    assert config["log"]["slack_webhook"] == "***" and "log.slack_webhook" in config["redacted"]
    assert "--log.slack_webhook=***" in json.loads((out / "environment.json").read_text())["command"]
    assert read_trainer_state(out / "step3")["config"]["log"]["slack_webhook"] == "***"
    changes = (out / "config_changes.jsonl").read_text()
    assert "train.max_steps" in changes and "slack_webhook" not in changes and "redacted" not in changes


@pytest.mark.parametrize("url", ["notaurl", "file:///etc/passwd", "ftp://example.com/hook"])
def test_a_webhook_that_is_no_http_url_is_one_sentence_that_does_not_show_it(url, monkeypatch):
    from config import ConfigError, parse_args
    from lab.notifier import Notifier

    with pytest.raises(ConfigError, match=r"log.slack_webhook must be an http:// or https:// URL") as refused:
        parse_args([f"--log.slack_webhook={url}"])
    assert url not in str(refused.value)
    monkeypatch.setenv("SLACK_WEBHOOK_URL", url)
    with pytest.raises(ConfigError, match="SLACK_WEBHOOK_URL environment variable must be an http") as refused:
        Notifier("", "run", is_master=False)  # every rank checks it, so that all stop
    assert url not in str(refused.value)


# ----------------------------------------------------------------------------- what a stop says, and keeps


def test_a_nan_between_collections_names_its_step_and_keeps_the_rows_before_it(data_root, tmp_path):
    import train
    from conftest import read_metrics

    out = tmp_path / "run"  # an absurd LR overflows the weights after the first update: step 2's loss is NaN
    result = run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=6",
                             "--optim.lr=1e20", "--optim.grad_clip=0", "--eval.interval=4",
                             "--log.metrics_collect_interval=10"], train.main)
    assert result.returncode == 1 and "train/loss is nan at step 2," in result.stderr, result.stderr
    assert "start again (the run has no checkpoint to resume) with a lower optim.lr" in result.stderr
    rows = read_metrics(out)
    assert rows[0]["step"] == 1 and rows[0]["train/loss"] > 10  # the finite step is on record
    assert not list(out.glob("step*"))


def test_a_run_without_checkpoints_that_stops_early_does_not_promise_a_resume(data_root, tmp_path):
    import train

    result = run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}",
                             "--train.max_steps=4", "--train.time_limit=1e-6", "--train.no_checkpoints=true"],
                            train.main)
    assert result.returncode == 0, result.stderr
    assert "saved no checkpoint, so running the command again starts from step 0" in result.stdout
    assert "resume" not in result.stdout and not list((tmp_path / "run").glob("step*"))


# ----------------------------------------------------------------------------- a character dataset's vocabulary


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """`python prepare_data.py shakespeare-char` and a 2-step run on it: (data root, run folder)."""
    import prepare_data
    import train

    root = tmp_path_factory.mktemp("char")
    run_in_process(["shakespeare-char", "--out_dir", str(root / "data" / "shakespeare-char")], prepare_data.main)
    out = root / "run"
    result = run_in_process(["config/shakespeare_char.py", *TINY, "--eval.interval=0", "--train.max_steps=2",
                             f"--data.data_root={root / 'data'}", f"--train.out_dir={out}"], train.main)
    assert result.returncode == 0, result.stderr
    return root / "data", out


def test_a_corrupt_or_reordered_vocabulary_is_one_sentence_in_sample_and_on_resume(char_run, tmp_path):
    import json
    import shutil

    import sample
    import train
    from conftest import assert_one_sentence

    data_root, trained = char_run
    root = tmp_path / "data"
    shutil.copytree(data_root, root)
    meta = root / "shakespeare-char" / "meta.json"
    vocab = json.loads(meta.read_text())["vocab"]
    sample_args = ["--num_samples=1", "--max_new_tokens=2", "--device=cpu"]

    def run_both(*phrases):
        out = tmp_path / "run"
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(trained, out)
        resumed = run_in_process(["config/shakespeare_char.py", *TINY, "--eval.interval=0", "--train.max_steps=3",
                                  f"--data.data_root={root}", f"--train.out_dir={out}"], train.main)
        assert_one_sentence(resumed, *phrases)
        assert not (out / "step3").exists()

    meta.write_text('{"vocab": ["a", ')  # cut short
    run_both("meta.json is not a readable character vocabulary", "python prepare_data.py shakespeare-char")
    meta.write_text(json.dumps({"vocab": vocab[::-1], "vocab_size": len(vocab)}))  # the same characters, reordered
    run_both("the dataset shakespeare-char", "is not the one this run trained on")
    import checkpoint
    state = checkpoint.read_trainer_state(trained / "step2")
    state["config"]["data"]["data_root"] = str(root)
    moved = tmp_path / "moved" / "step2"  # the checkpoint, pointed at the reordered data
    shutil.copytree(trained / "step2", moved)
    torch.save(state, moved / "trainer.pt")
    marker = json.loads((moved / "COMPLETE").read_text())
    marker["files"]["trainer.pt"] = checkpoint.sha256_file(moved / "trainer.pt")
    (moved / "COMPLETE").write_text(json.dumps(marker))
    assert_one_sentence(run_in_process(["--init_from", moved, *sample_args], sample.main),
                        "is not the one", "its ids would decode to other characters")
    meta.write_text('{"vocab": ["a", ')
    assert_one_sentence(run_in_process(["--init_from", moved, *sample_args], sample.main),
                        "meta.json is not a readable character vocabulary")


def test_a_vocab_size_below_the_characters_names_the_setting_to_change(char_run, tmp_path):
    import train
    from conftest import assert_one_sentence

    data_root, _ = char_run
    result = run_in_process(["config/shakespeare_char.py", *TINY, "--model.vocab_size=60", "--train.max_steps=2",
                             f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}"], train.main)
    assert_one_sentence(result, "set --model.vocab_size=82, the number of characters in its meta.json")


# ----------------------------------------------------------------------------- files that pass their checksums


@pytest.fixture(scope="module")
def tiny_run(data_root, tmp_path_factory):
    """A 2-step run with a checkpoint at each step (a module's worth of tests copy it)."""
    import train

    out = tmp_path_factory.mktemp("tiny") / "run"
    result = run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0",
                             "--train.max_steps=2", "--checkpoint.interval=1"], train.main)
    assert result.returncode == 0, result.stderr
    return out


def rewrite(checkpoint_dir, name, obj):
    """Save `obj` as checkpoint file `name` and put its checksum in COMPLETE, as anyone handing one over can."""
    import json

    from checkpoint import sha256_file
    torch.save(obj, checkpoint_dir / name)
    marker = json.loads((checkpoint_dir / "COMPLETE").read_text())
    marker["files"][name] = sha256_file(checkpoint_dir / name)
    (checkpoint_dir / "COMPLETE").write_text(json.dumps(marker))


def every_file(root):
    """{path: (size, mtime)} of every file under `root`: what a refused command must leave as it was."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            status = os.lstat(os.path.join(folder, name))
            found[os.path.join(folder, name)] = (status.st_size, status.st_mtime_ns)
    return found


def test_a_file_of_a_checkpoint_that_is_a_link_is_refused_by_every_reader_and_nothing_is_written(
        tiny_run, data_root, tmp_path):
    """model.pt as a link to a copy of itself outside the checkpoint (its checksum passes): train.py's resume,
    sample.py and hellaswag_eval.py each refuse it in one sentence, and write nothing."""
    import shutil

    import hellaswag_eval
    import sample
    import train
    from conftest import assert_one_sentence

    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(tiny_run, out, symlinks=True)
    elsewhere.mkdir()
    shutil.copy(out / "step2" / "model.pt", elsewhere / "model.pt")
    (out / "step2" / "model.pt").unlink()
    (out / "step2" / "model.pt").symlink_to(elsewhere / "model.pt")
    before = every_file(tmp_path)
    said = [f"step2/model.pt is a link (to {elsewhere / 'model.pt'}), and a checkpoint is read only from its own",
            "put the file itself in its place"]
    resumed = run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0",
                              "--train.max_steps=3"], train.main)
    assert_one_sentence(resumed, *said)
    for main in (sample.main, hellaswag_eval.main):
        assert_one_sentence(run_in_process(["--init_from", out / "step2", "--device=cpu"], main), *said)
    assert every_file(tmp_path) == before


@pytest.mark.parametrize("linked", ["trainer.pt", "optim.pt", "COMPLETE"])
def test_every_file_of_a_checkpoint_that_is_a_link_is_refused_and_the_latest_link_is_followed(tiny_run, tmp_path,
                                                                                              linked):
    import shutil

    from checkpoint import UntrustedCheckpoint, read_file, verify_checkpoint

    out = tmp_path / "run"
    shutil.copytree(tiny_run, out, symlinks=True)
    verify_checkpoint(str(out / "latest"))  # the run's own link to its newest checkpoint folder
    shutil.move(out / "step2" / linked, tmp_path / linked)
    (out / "step2" / linked).symlink_to(tmp_path / linked)
    with pytest.raises(UntrustedCheckpoint, match=f"step2/{linked} is a link"):
        verify_checkpoint(str(out / "step2"))
    with pytest.raises(UntrustedCheckpoint, match=f"step2/{linked} is a link"):  # a reader that verified nothing
        read_file(str(out / "step2"), "model.pt")


@pytest.mark.parametrize("name, content", [("model.pt", [1, 2]), ("optim.pt", {"lr": 1.0}), ("trainer.pt", 3),
                                           ("model.pt", "code")])
def test_a_checkpoint_file_that_holds_something_else_is_one_sentence(tiny_run, data_root, tmp_path, name, content):
    import shutil

    import sample
    import train
    from conftest import assert_one_sentence

    out = tmp_path / "run"
    shutil.copytree(tiny_run, out, symlinks=True)
    if content == "code":  # an object weights_only refuses to build: nothing of it runs
        content = RunsCode(tmp_path / "ran")
    rewrite(out / "step2", name, content)
    what = {"model.pt": "weights by name", "optim.pt": "an optimizer's state", "trainer.pt": "the trainer's state"}
    resumed = run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0",
                              "--train.max_steps=3"], train.main)
    assert_one_sentence(resumed, f"step2/{name}", what[name], "give a checkpoint this trainer saved")
    assert not (out / "step3").exists() and not (tmp_path / "ran").exists()
    if name != "optim.pt":  # (sampling reads no optimizer)
        assert_one_sentence(run_in_process(["--init_from", out, "--device=cpu", "--max_new_tokens=2"], sample.main),
                            f"step2/{name}", what[name])


def test_a_damaged_marker_in_the_bucket_or_the_folder_is_a_one_line_warning(s3, tiny_run, tmp_path):
    import shutil

    import checkpoint
    from lab import remote
    import sample

    url = "s3://runs/damaged"
    fs, root = remote.filesystem(url)
    for step in ("step1", "step2", "step3"):  # step3: step2 again, so that two steps are newer than step1
        fs.put(str(tiny_run / min(step, "step2")), f"{root}/{step}", recursive=True)
    fs.pipe_file(f"{root}/step2/COMPLETE", b"{}")
    fs.pipe_file(f"{root}/step3/COMPLETE", b"[1, 2]")
    result = run_in_process(["--init_from", url, "--device=cpu", "--max_new_tokens=2", "--num_samples=1"], sample.main)
    assert result.returncode == 0, result.stderr
    for step in ("step2", "step3"):
        assert f"warning: {url}/{step}/COMPLETE is no readable COMPLETE marker, so {step} is not used" in result.stderr
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out, symlinks=True)
    (out / "step2" / "COMPLETE").write_text("[1, 2]")
    listed = run_in_process(["list", out], checkpoint.main)
    assert f"warning: {out / 'step2'} has an unreadable COMPLETE marker" in listed.stderr
    assert "UserWarning" not in listed.stderr and "step1" in listed.stdout


def test_the_bucket_start_messages_name_every_step_and_the_run_they_hold(s3, tiny_run, data_root, tmp_path):
    import json
    import shutil

    from lab import remote
    import train
    from conftest import assert_one_sentence

    url = "s3://runs/many"  # the run's config and five complete (empty) checkpoints: what the start reads
    fs, root = remote.filesystem(url)
    fs.pipe_file(f"{root}/config.json", (tiny_run / "config.json").read_bytes())
    for step in (2, 4, 6, 8, 10):
        fs.pipe_file(f"{root}/step{step}/COMPLETE", json.dumps({"step": step, "files": {}}).encode())
    common = [*TINY, f"--data.data_root={data_root}", "--eval.interval=0", "--train.max_steps=2",
              "--checkpoint.interval=1", f"--checkpoint.remote_folder={url}"]
    fresh = run_in_process([*common, f"--train.out_dir={tmp_path / 'fresh'}", "--checkpoint.load=never"], train.main)
    assert_one_sentence(fresh, "holds checkpoints (5 steps: 2, ..., 6, 8, 10) and this run starts afresh")
    own = tmp_path / "own"  # this run's folder, whose run the bucket holds, resumed with another seed
    shutil.copytree(tiny_run, own, symlinks=True)
    seed = run_in_process([*common, f"--train.out_dir={own}", "--train.seed=7"], train.main)
    assert_one_sentence(seed, f"{own} and checkpoint.remote_folder={url} hold a run with train.seed=1337",
                        "set --train.seed=1337 to resume it", "--checkpoint.save_overwrite=true to replace it in both")
    assert "another run" not in seed.stderr


def test_a_list_setting_takes_the_brackets_help_shows():
    from config import parse_args

    cfg = parse_args(["--checkpoint.fixed_steps=[3]", "--eval.fixed_steps=[1, 4]", "--log.wandb_tags=['a', 'b']"])
    assert (cfg.checkpoint.fixed_steps, cfg.eval.fixed_steps, cfg.log.wandb_tags) == ([3], [1, 4], ["a", "b"])
    assert parse_args(["--checkpoint.fixed_steps=[]"]).checkpoint.fixed_steps == []


def test_a_hard_stop_below_the_checkpoint_names_itself_and_records_no_change(tiny_run, data_root, tmp_path):
    import shutil

    import train

    out = tmp_path / "run"
    shutil.copytree(tiny_run, out, symlinks=True)
    before = sorted(os.listdir(out))
    result = run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0",
                             "--train.max_steps=4", "--checkpoint.interval=1", "--train.hard_stop=1"], train.main)
    assert result.returncode == 0, result.stderr
    assert "already trained to step 2; nothing to do (train.hard_stop=1 stops it at step 1: raise it" in result.stdout
    assert "train.max_steps" not in result.stdout and sorted(os.listdir(out)) == before  # no config_changes.jsonl


def test_a_shape_from_the_default_config_file_is_one_clean_sentence():
    from lab.hf import WeightsError, use_source_shape
    from model import GPTConfig

    shape = {**dataclasses.asdict(GPTConfig()), "n_layer": 12}
    with pytest.raises(WeightsError) as refused:
        use_source_shape(shape, GPTConfig(n_layer=6), "gpt2", "GPT-2", default_config=True)
    assert "model.n_layer=6 (in config/shakespeare.py, the default config file); the shape" in str(refused.value)
    assert ",;" not in str(refused.value)


def test_warnings_after_the_run_ended_do_not_say_training_goes_on(capsys):
    from metrics import warn_slow
    from lab.notifier import Notifier

    with Notifier("http://127.0.0.1:9/nobody", "run", is_master=True) as notifier:  # nothing listens on port 9
        notifier.outcome = "finished at step 2"
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith("training goes on.") and lines[-1].endswith("the run's outcome is as printed above.")
    warn_slow("waiting for the previous checkpoint", 0.0042, 0.001)
    assert "took 0.0042 s, more than log.bookkeeping_soft_timeout=0.001 s" in capsys.readouterr().err


def test_a_model_file_that_builds_another_width_names_that_field(data_root, tmp_path):
    import train
    from conftest import assert_one_sentence

    wide = tmp_path / "wide.py"
    wide.write_text("import dataclasses, model\n"
                    "class GPT(model.GPT):\n"
                    "    def __init__(self, config, loss_path='chunked'):\n"
                    "        super().__init__(dataclasses.replace(config, n_embd=2 * config.n_embd), loss_path)\n")
    result = run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}",
                             f"--train.model_module={wide}"], train.main)
    assert_one_sentence(result, "(model.n_embd=32, it built 64)")
    assert "n_layer" not in result.stderr and not (tmp_path / "run").exists()


def test_an_alternative_ladder_folder_that_does_not_exist_is_said(s3, data_root, tmp_path):
    from conftest import run_ladder
    from test_ladder import micro_ladder_file

    path = micro_ladder_file(tmp_path, data_root)
    result = run_ladder("checkpoints", path, f"--ladder.alternative_dirs={tmp_path / 'nowhere'},s3://runs/nowhere",
                        "--json")
    assert result.returncode == 0, result.stderr
    for folder in (tmp_path / "nowhere", "s3://runs/nowhere"):
        assert f"note: ladder.alternative_dirs has {folder}, which does not exist" in result.stderr
