"""What the answer's process runs besides the answer: the helpers that the feed_*.py modules share.

An answer runs in a process of its own, in the room (room.py), and meets its check only through data
(grading.py): a `feed_*.py` module's function (`*_answers`) builds what the answer is given (a tiny GPT,
a training run, a DDP model), calls the answer's functions on the inputs the check saved, and returns what
they gave as plain data (`plain`). This module and the feed modules hold no expected value, no comparison
and no advice: the room holds them, and the checks (checks_*.py), which do, stay out of it.
"""

import contextlib
import inspect
import io
import json
import os

import torch


class ExerciseFailed(Exception):
    """The answer differs from the project; the message says how, in one sentence."""


def tiny_gpt(seed, **shape):
    """A GPT small enough that a CPU runs it in milliseconds: 2 blocks, width 32, 512 tokens."""
    from model import GPT, GPTConfig

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
    appended to the list this yields, by name. On a CPU nothing waits, so the check counts the calls: by the
    tensor methods' names, and below them where torch itself reads one number out (`aten._local_scalar_dense`,
    what .item() and float() come to), which also sees a method an answer kept from before the spies were in."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class ScalarReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default and not calls:
                calls.append("item")
            return func(*args, **(kwargs or {}))

    with contextlib.ExitStack() as stack:
        for name in HOST_SYNCS:
            original = getattr(torch.Tensor, name)

            def spy(self, *args, _name=name, _original=original, **kwargs):
                calls.append(_name)
                return _original(self, *args, **kwargs)

            stack.enter_context(patched(torch.Tensor, name, spy))
        stack.enter_context(ScalarReads())
        yield calls


# A training run of a few seconds on a laptop CPU (tests/conftest.py's TINY), with AdamW, the optimizer the
# exercises build (the quick start's config trains with Muon), and the cosine schedule (the quick start's WSD needs
# its warmup and decay within the run).
TINY_RUN = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
            "--data.batch_size=4", "--train.total_batch_size=128", "--optim.warmup_steps=2",
            "--eval.val_steps=2", "--eval.sample_interval=0", "--log.interval=1", "--optim.name=adamw",
            "--optim.schedule=cosine"]


def run_training(args):
    """train.main(args) in this process (as tests/conftest.py's run_in_process), its output kept out of
    the student's terminal; returns its metrics.jsonl as one row per step (a step logged in two rows, as the
    last step's evaluation may be, is merged). A user error of the run is one sentence; any other error goes
    up to the caller, which names it."""
    import train
    from config import UserError

    cwd = os.getcwd()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            train.main(args)
    except UserError as error:
        raise ExerciseFailed(f"the check's training run stopped: {error}") from None
    finally:
        os.chdir(cwd)
    out_dir = next(arg.split("=", 1)[1] for arg in args if arg.startswith("--train.out_dir="))
    rows = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for row in (json.loads(line) for line in f if line.strip()):
            rows.setdefault(row["step"], {}).update(row)
    return list(rows.values())


# ----------------------------------------------------------------------------- the answer side: plain data


def plain(value):
    """`value` as data that torch.load(weights_only=True) reads back: tensors (detached, on the CPU), numbers,
    strings, None, and lists, tuples and dicts of them. Anything else becomes {"unplain": its type, "repr": ...},
    so the grading side can say what came back without running any of the answer's code."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone().as_subclass(torch.Tensor)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value) if type(value) in (list, tuple) else [plain(v) for v in value]
    if isinstance(value, dict):
        return {plain(k) if isinstance(k, (str, int, tuple)) else repr(k): plain(v) for k, v in value.items()}
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a NumPy scalar
        return value.item()
    return {"unplain": type(value).__name__, "repr": repr(value)[:120]}


def gradients(model):
    """{name: a copy of the parameter's gradient, or None}."""
    return {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}
