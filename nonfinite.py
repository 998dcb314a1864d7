"""The run's end on a non-finite loss or gradient: `NonFiniteLoss` and the sentence that says how to go on. A module
of its own because only a step that went non-finite reaches it (step_extras.StepExtras.stop_on_nonfinite imports it
there), so a healthy run never reads it. Finding the NaN is callbacks.py's, and the loop's.
"""

import os

from callbacks import host_values, nonfinite_message
from checkpoint import newest_checkpoint
from config import UserError


class NonFiniteLoss(UserError):
    """Training produced NaN or Inf; the message says what to do."""


def nonfinite_stop(what, out_dir, skip=True):
    """NonFiniteLoss for `what` (what went non-finite, and where), with the way on for this run: resume from its last
    checkpoint, or start again if it has none. `skip`: offer train.nan_policy=skip (a run that skips has a limit)."""
    last = newest_checkpoint(out_dir) if out_dir else None
    restart = f"resume from its last checkpoint, {os.path.basename(last)}," if last else \
        "start again (the run has no checkpoint to resume)"
    then = ", or set train.nan_policy=skip to skip such steps" if skip else \
        " (train.nan_skip_limit sets how many in a row)"
    return NonFiniteLoss(f"{what}; {restart} with a lower optim.lr{then}.")


def check_finite(step, values, out_dir=None):
    """NonFiniteLoss, naming `step`, if the step's train/loss or train/grad_norm is not finite."""
    message = nonfinite_message(step, host_values(values))
    if message:
        raise nonfinite_stop(message, out_dir)
