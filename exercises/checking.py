"""What every exercise check shares: the failures with their one sentence, and small helpers.

A check has two sides, which never share a process (grading.py says how they meet):
- the grading side (`check_*`, in the teacher's check.py process) makes the inputs, computes the
  reference from the project's own code as it is today (optimizer.py, train.py, model.py, torch, tiktoken,
  ...), and compares; it never imports an answer file;
- the answer side (`*_answers`, run by runner.py in a process of its own) loads the student's answer file,
  runs its functions on those inputs and sends back their results as plain data (`plain`).
When the two differ, the grading side raises `ExerciseFailed` with one sentence: what differs, by how much,
and where to look. tests/test_exercises.py runs every check on the project's answers (each must pass) and
on wrong ones (each must fail).

The checks' models are so small that one thread runs them fastest: a second thread only waits for the
first (on a busy 2-core machine a tiny forward and backward pass takes 0.5 s on two threads and 2 ms on
one), so both sides run on one thread.
"""

import contextlib
import inspect
import io
import json
import math
import os

import torch


class ExerciseFailed(Exception):
    """The answer differs from the project; the message says how, in one sentence."""


class NotDone(Exception):
    """An answer function is not written yet; the message names it."""


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


# A training run of a few seconds on a laptop CPU (tests/conftest.py's TINY), with AdamW, the optimizer the
# exercises build (the quick start's config trains with Muon).
TINY_RUN = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
            "--data.batch_size=4", "--train.total_batch_size=128", "--optim.warmup_steps=2",
            "--eval.val_steps=2", "--eval.sample_interval=0", "--log.interval=1", "--optim.name=adamw"]


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


# ----------------------------------------------------------------------------- the grading side: comparing


def is_close(mine, want, rel=1e-9):
    """Equal up to float rounding; an infinity equals only itself; anything but a number, nothing."""
    if isinstance(mine, (dict, list, tuple, str)) or mine is None:
        return False
    try:
        mine = float(mine)
    except (TypeError, ValueError, RuntimeError):
        return False
    return mine == want or math.isclose(mine, want, rel_tol=rel)


def shown(mine, want):
    """The two numbers as text, with just enough digits to tell them apart (mine as it came if it is
    not a number)."""
    if isinstance(mine, dict) and "unplain" in mine:
        return f"a {mine['unplain']} ({mine['repr']})", f"{want:.6g}"
    try:
        mine = float(mine)
    except (TypeError, ValueError, RuntimeError):
        return repr(mine)[:80], f"{want:.6g}"
    digits = next((d for d in range(6, 18) if f"{mine:.{d}g}" != f"{want:.{d}g}"), 17)
    return f"{mine:.{digits}g}", f"{want:.{digits}g}"


def same_tensor(mine, want, tolerance=1e-5):
    return (torch.is_tensor(mine) and mine.shape == want.shape and mine.dtype == want.dtype
            and torch.allclose(mine, want, rtol=tolerance, atol=tolerance))


def gradient_advice(what, mine, want, tolerance=1e-4, truth="model.py's"):
    """None when `mine`, the gradient that came back for `what` (None: it got none), equals `want`; else the end
    of a sentence that names the mistake by its shape: no gradient (something detached), the right direction
    at another scale (the graph counted more than once), or another direction (a term missing)."""
    if want is None or not want.abs().any():  # (a key's bias: softmax ignores a shift of all the scores)
        return None if not torch.is_tensor(mine) or mine.float().norm() < 1e-6 else (
            f"{what} gets a gradient where {truth} gives it none")
    if not torch.is_tensor(mine) or not mine.abs().any():
        return (f"no gradient reaches {what}: part of your computation is cut off from autograd (.detach(), "
                f"torch.no_grad(), .item() or a NumPy round trip)")
    mine = mine.float()
    scale = (mine.norm() / want.norm().clamp_min(1e-30)).item()
    error = ((mine - want).norm() / want.norm().clamp_min(1e-30)).item()
    if error <= tolerance:
        return None
    cosine = torch.nn.functional.cosine_similarity(mine.flatten(), want.flatten(), dim=0).item()
    if cosine > 1 - 1e-6:
        return (f"the gradient of {what} is {scale:.3g} times {truth} while the value is right: the graph is "
                f"counted {scale:.3g} times (as in loss + (loss - loss.detach())); compute the value once")
    return (f"the gradient of {what} differs from {truth} by {error:.1%} while the value is right: a term of the "
            f"gradient is missing, as when a piece of the computation (a normaliser, a mean) is detached or "
            f"computed outside autograd; keep every piece in the graph")
