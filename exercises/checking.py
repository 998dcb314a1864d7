"""What every exercise check shares: the failure with its one sentence, and small helpers.

A check (checks_step.py: exercises 1-5, one training step; checks_run.py: 6-9, the run around it)
takes `answers`, the module of an exercise file (or any object with the same functions), runs them
beside the project's own code on fresh random inputs or in a short real training run, and returns a
one-line summary when they agree. When they do not, it raises `ExerciseFailed` with one sentence:
what differs, by how much, and where to look. The truth is always the project's code as it is today
(optimizer.py, train.py, model.py, ...), never the answer file, so a check keeps testing the right
thing when the project changes; tests/test_exercises.py runs every check against the project's
answers (it must pass) and against wrong ones (it must fail).

The checks' models are so small that one thread runs them fastest: a second thread only waits for
the first (on a busy 2-core machine a tiny forward and backward pass takes 0.5 s on two threads and
2 ms on one), so check.py and the tests run the checks on one thread.
"""

import contextlib
import inspect
import io
import json
import math
import os

import torch

from config import UserError
from model import GPT, GPTConfig


class ExerciseFailed(Exception):
    """The answer differs from the project; the message says how, in one sentence."""


def tiny_gpt(seed, **shape):
    """A GPT small enough that a CPU runs it in milliseconds: 2 blocks, width 32, 512 tokens."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 512, **shape}))


@contextlib.contextmanager
def patched(owner, name, value):
    """`owner.name = value` inside a `with` block; the project's own comes back after it (as it was
    written: a classmethod stays a classmethod)."""
    original = inspect.getattr_static(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


# What makes the host wait for the device on a GPU: a tensor's value read into Python.
HOST_SYNCS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__")


@contextlib.contextmanager
def host_syncs():
    """Inside the block, each call that reads a tensor's value into Python (a host-device sync on a GPU) is
    appended to the list this yields, by name. On a CPU nothing waits, so the check counts the calls."""
    calls = []
    with contextlib.ExitStack() as stack:
        for name in HOST_SYNCS:
            original = getattr(torch.Tensor, name)

            def spy(self, *args, _name=name, _original=original, **kwargs):
                calls.append(_name)
                return _original(self, *args, **kwargs)

            stack.enter_context(patched(torch.Tensor, name, spy))
        yield calls


# A training run of a few seconds on a laptop CPU (tests/conftest.py's TINY).
TINY_RUN = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
            "--data.batch_size=4", "--train.total_batch_size=128", "--optim.warmup_steps=2",
            "--eval.val_steps=2", "--eval.sample_interval=0", "--log.interval=1"]


def run_training(args):
    """train.main(args) in this process (as tests/conftest.py's run_in_process), its output kept out of
    the student's terminal; returns the rows of its metrics.jsonl. A user error of the run is one
    sentence; any other error (the student's code, or project code that a wrong answer broke) goes up
    to check.py, which names it."""
    import train

    cwd = os.getcwd()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train.main(args)
    except UserError as error:
        raise ExerciseFailed(f"the check's training run stopped: {error}") from None
    finally:
        os.chdir(cwd)
    out_dir = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--train.out_dir="))
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def is_close(mine, want, rel=1e-9):
    """Equal up to float rounding; an infinity equals only itself; anything but a number, nothing."""
    try:
        mine = float(mine)
    except (TypeError, ValueError):
        return False
    return mine == want or math.isclose(mine, want, rel_tol=rel)


def shown(mine, want):
    """The two numbers as text, with just enough digits to tell them apart (mine as it came if it is
    not a number)."""
    try:
        mine = float(mine)
    except (TypeError, ValueError):
        return repr(mine), f"{want:.6g}"
    digits = next((d for d in range(6, 18) if f"{mine:.{d}g}" != f"{want:.{d}g}"), 17)
    return f"{mine:.{digits}g}", f"{want:.{digits}g}"
