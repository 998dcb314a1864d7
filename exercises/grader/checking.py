"""What every exercise check shares: the failures with their one sentence, and small helpers.

A check has two sides, which never share a process (grading.py says how they meet):
- the grading side (`check_*`, in the teacher's check.py process) makes the inputs, computes the
  reference from the project's own code as it is today (optimizer.py, train.py, model.py, torch, tiktoken,
  ...), and compares; it never imports an answer file;
- the answer side (`*_answers`, in a `feed_*.py` module beside each `checks_*.py`, run by runner.py in a
  process of its own, in the room) calls the student's functions on those inputs and sends back their
  results as plain data (`plain`). It holds no expected value and no advice (feeding.py), so that the room
  holds none either.
When the two differ, the grading side raises `ExerciseFailed` with one sentence: what differs, by how much,
and where to look. tests/test_exercises.py runs every check on the project's answers (each must pass) and
on wrong ones (each must fail).

The checks' models are so small that one thread runs them fastest: a second thread only waits for the
first (on a busy 2-core machine a tiny forward and backward pass takes 0.5 s on two threads and 2 ms on
one), so both sides run on one thread.
"""

import math

import torch

# The helpers both sides use, which live on the answer's side (the room holds them): a check imports them here.
from exercises.grader.feeding import (ExerciseFailed, TINY_RUN, gradients, host_syncs, patched, plain,  # noqa: F401
                               run_training, tiny_gpt)


class NotDone(Exception):
    """An answer function is not written yet; the message names it."""


class GraderFailed(Exception):
    """The grader could not run the answer (the machine, the sandbox, the Python install): never the student's
    doing, so check.py says so and asks for the teacher."""


def from_the_answer(text, limit=300):
    """`text` that came from the answer's process, fit to print in the grader's one line: cut to `limit`
    characters, every control character (ANSI escapes, carriage returns, new lines, direction marks) and
    every separator but the plain space (U+2028's line, U+2029's paragraph, a no-break space) written as its
    escape, so that nothing the answer prints can rewrite the line around it or pass for another line."""
    import unicodedata

    text = str(text)[:limit]
    return "".join(c.encode("unicode_escape").decode() if unicodedata.category(c)[0] in "CZ" and c != " " else c
                   for c in text)


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


def shown(mine):
    """The answer's value as text: a number to 6 significant digits, else as it came (cut short). Never the
    expected value: a failure that printed it, digit by digit as the answer came closer, would let a few
    retries read it off instead of the rule (tests/test_exercises.py looks in every failure)."""
    if isinstance(mine, dict) and "unplain" in mine:
        return f"a {mine['unplain']} ({mine['repr']})"
    if isinstance(mine, bool) or not isinstance(mine, (int, float, torch.Tensor)) or (
            torch.is_tensor(mine) and mine.numel() != 1):
        return repr(mine)[:80]
    return f"{float(mine):.6g}"


def compared(mine, want):
    """How `mine` misses `want`, told without `want`'s digits: "larger than", "smaller than", or "other than"."""
    try:
        mine = float(mine)
    except (TypeError, ValueError, RuntimeError):
        return "other than"
    return "larger than" if mine > want else "smaller than" if mine < want else "other than"


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
