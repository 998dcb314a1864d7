"""Preparing data never destroys a user's files, and a refused `python prepare_data.py ...` changes nothing.

A dataset folder is replaced whole when it is prepared again, so data.py (and train.py, which prepares
the built-in datasets on first use) replaces only a folder it made itself; any other folder, a dataset
name that leads outside the data root, and an out-of-range argument are refused with one sentence
before anything is written."""

import json
import os

import numpy as np
import pytest

import prepare_data
from conftest import TINY, assert_one_sentence, run_in_process, run_train


def snapshot(root):
    """Every path under root with its contents (or its link target), to compare before and after."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                seen[os.path.relpath(path, root)] = "link to " + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    seen[os.path.relpath(path, root)] = f.read()
            else:
                seen[os.path.relpath(path, root)] = "folder"
    return seen


def run_data(*args):
    return run_in_process(args, prepare_data.main)


@pytest.fixture
def essays(tmp_path):
    """A folder of the user's own writing, the input of `python prepare_data.py text`."""
    folder = tmp_path / "essays"
    folder.mkdir()
    for i in range(3):
        (folder / f"essay{i}.txt").write_text(f"Essay number {i}: on the use of commas. " * 40)
    return folder


@pytest.fixture
def no_shard_is_written(monkeypatch):
    """A regression of --shard_tokens=0 would fill the disk forever: stop at the first shard instead."""
    def refuse(path, tokens):
        pytest.fail(f"a refused command wrote the shard {path}")

    monkeypatch.setattr(prepare_data, "write_shard", refuse)


@pytest.fixture
def local_fineweb(monkeypatch, tmp_path):
    """FineWeb-Edu from a local file instead of the HF hub (this machine has no network)."""
    import datasets

    local = tmp_path.parent / f"{tmp_path.name}-fineweb.jsonl"
    local.write_text("\n".join(json.dumps({"text": f"Web page {i}. " * 30}) for i in range(20)))
    real_load = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: real_load(
        "json", data_files=str(local), split="train", streaming=True))


# ----------------------------------------------------------------------------- a folder that is not ours


@pytest.mark.parametrize("dataset", ["text", "shakespeare", "python-stdlib", "fineweb-edu"])
def test_preparing_into_the_folder_of_the_users_files_is_refused_and_keeps_them(
        dataset, essays, tmp_path, local_fineweb):
    paths = [str(p) for p in sorted(essays.iterdir())] if dataset == "text" else []
    before = snapshot(tmp_path)
    result = run_data(dataset, *paths, f"--out_dir={essays}", "--workers=1")
    assert_one_sentence(result, str(essays), "essay0.txt", "new folder")
    assert snapshot(tmp_path) == before


def test_an_out_dir_that_is_a_file_is_refused_and_kept(essays, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("my notes")
    before = snapshot(tmp_path)
    result = run_data("text", str(essays / "essay0.txt"), f"--out_dir={target}")
    assert_one_sentence(result, str(target), "not a folder")
    assert snapshot(tmp_path) == before


def test_train_refuses_to_prepare_shakespeare_over_a_users_file_and_keeps_it(tmp_path):
    root = tmp_path / "root"
    (root / "shakespeare").mkdir(parents=True)
    (root / "shakespeare" / "sonnets.txt").write_text("Shall I compare thee to a summer's day?\n")
    before = snapshot(tmp_path)
    result = run_train(TINY + [f"--data.data_root={root}", f"--train.out_dir={tmp_path / 'run'}",
                               "--train.max_steps=3"], check=False)
    assert_one_sentence(result, "sonnets.txt")
    assert snapshot(tmp_path) == before


def test_preparing_again_replaces_a_folder_data_py_made_even_a_partial_one(essays, tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # an empty folder holds nothing to lose
    args = ("text", *map(str, sorted(essays.glob("*.txt"))), f"--out_dir={out}", "--shard_tokens=300", "--workers=1")
    assert run_data(*args).returncode == 0
    first = snapshot(out)
    # What an interrupted preparation leaves: a half-written shard and progress file beside finished shards.
    (out / "train_000009.npy.tmp.npy").write_bytes(b"half a shard")
    (out / "progress.json.tmp").write_text("{")
    result = run_data(*args)
    assert result.returncode == 0, result.stderr
    assert snapshot(out) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["essays", "out"]  # no .new- or .old folder left


def test_preparing_through_a_symlink_replaces_the_folder_it_names_and_keeps_the_link(essays, tmp_path):
    (tmp_path / "disk").mkdir()
    link = tmp_path / "ds"
    link.symlink_to(tmp_path / "disk" / "ds")
    args = ("text", str(essays / "essay0.txt"), f"--out_dir={link}", "--workers=1")
    assert run_data(*args).returncode == 0
    assert run_data(*args).returncode == 0
    assert link.is_symlink() and (tmp_path / "disk" / "ds" / "train_000001.npy").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "ds", "essays"]
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["ds"]


# ----------------------------------------------------------------------------- a dataset name outside data_root


@pytest.mark.parametrize("name", ["../../etc", "../shakespeare", "/tmp/elsewhere", "mine/sub", "..", "."])
def test_dry_run_refuses_a_dataset_name_that_leaves_the_data_root(name, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    before = snapshot(tmp_path)
    result = run_train(TINY + [f"--data.data_root={root}", f"--data.dataset={name}", "--dry_run"], check=False)
    assert_one_sentence(result, repr(name))
    assert "--out_dir" not in result.stdout + result.stderr  # no hint to write the dataset out there
    assert snapshot(tmp_path) == before


def test_train_does_not_prepare_a_dataset_outside_the_data_root(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    before = snapshot(tmp_path)
    result = run_train(TINY + [f"--data.data_root={root}", "--data.dataset=../shakespeare",
                               f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=3"], check=False)
    assert_one_sentence(result, "'../shakespeare'")
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- argument ranges


@pytest.mark.parametrize("argument, phrase", [
    ("--shard_tokens=0", "--shard_tokens"), ("--shard_tokens=-5", "--shard_tokens"),
    ("--val_fraction=1.5", "--val_fraction"), ("--val_fraction=1", "--val_fraction"),
    ("--val_fraction=0", "--val_fraction"), ("--val_fraction=nan", "--val_fraction"),
    ("--workers=0", "--workers")])
@pytest.mark.parametrize("dataset", ["text", "fineweb-edu"])
def test_an_argument_out_of_range_is_refused_before_anything_is_written(
        dataset, argument, phrase, essays, tmp_path, no_shard_is_written, local_fineweb):
    paths = [str(p) for p in sorted(essays.iterdir())] if dataset == "text" else []
    before = snapshot(tmp_path)
    result = run_data(dataset, *paths, f"--out_dir={tmp_path / 'out'}", argument)
    assert_one_sentence(result, phrase)
    assert snapshot(tmp_path) == before


def test_a_val_fraction_inside_the_range_leaves_a_train_shard(essays, tmp_path):
    result = run_data("text", str(essays / "essay0.txt"), f"--out_dir={tmp_path / 'out'}", "--val_fraction=0.99")
    assert result.returncode == 0, result.stderr
    train = np.concatenate([np.load(p) for p in sorted((tmp_path / "out").glob("train_*.npy"))])
    assert len(train) >= 1


def test_a_users_empty_folder_keeps_its_permissions_when_a_dataset_is_prepared_into_it(tmp_path):
    (tmp_path / "in.txt").write_text("To be, or not to be: that is the question. " * 200)
    target = tmp_path / "mine"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    result = run_in_process(["text", str(tmp_path / "in.txt"), "--out_dir", str(target)], prepare_data.main)
    assert result.returncode == 0, result.stderr
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(target).st_mode & 0o777 == 0o777 & ~umask  # an ordinary folder, not mkdtemp's private 0700
