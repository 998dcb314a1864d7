"""Shared test helpers: a tiny model config and a way to run train.py as a user would."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A model small enough that a CPU trains it in well under a second per step.
TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
        "--data.batch_size=4", "--train.total_batch_size=128", "--optim.warmup_steps=2",
        "--eval.val_steps=2", "--eval.sample_interval=0", "--log.interval=1"]


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """The real built-in Shakespeare dataset, prepared once for the whole session."""
    from data import prepare_shakespeare

    root = tmp_path_factory.mktemp("data")
    prepare_shakespeare(str(root / "shakespeare"))
    return root


def run_train(args, nproc=1, timeout=600, check=True, env=None):
    """Run train.py in a subprocess; with nproc > 1 through torchrun with the gloo backend."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    else:
        cmd = [sys.executable]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(cmd + [str(ROOT / "train.py")] + args, cwd=ROOT, capture_output=True,
                            text=True, timeout=timeout, env=full_env)
    if check and result.returncode != 0:
        raise AssertionError(f"train.py failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def read_metrics(out_dir):
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def mixture_root(data_root, tmp_path_factory):
    """Shakespeare beside a second real corpus, the Python standard library (`python data.py python-stdlib`)."""
    root = tmp_path_factory.mktemp("mixture")
    (root / "shakespeare").symlink_to(data_root / "shakespeare")
    subprocess.run([sys.executable, str(ROOT / "data.py"), "python-stdlib", "--out_dir", str(root / "python")],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    return root
