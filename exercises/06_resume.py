"""Exercise 6: resuming exactly, or what a checkpoint must hold.

Goal: write what the trainer saves beside the weights and the optimizer, and how it comes back, so
that a run stopped at step 4 and resumed trains steps 5 to 8 with bit-identical losses to a run that
never stopped. Weights and optimizer state are not enough: the loop's counters, where the data
loader was, and the random number generators (dropout draws from them) must come back too.
In the project: checkpoint.py, `TrainState` (`to_dict`, `from_dict`), `rng_state`, `set_rng_state`,
`Checkpointer.save`; run_dir.py's `load_start` (where a resume restores them).
Check: python exercises/check.py 6
(short real runs with dropout on: in your answer's process, one stopped after step 4 then resumed with your
four functions; in the check's, one of 8 steps that never stopped; the losses of steps 5 to 8 must be identical)
"""

import random

import numpy as np
import torch

from checkpoint import TrainState


def trainer_state_to_dict(state):
    """The dict a checkpoint's trainer.pt holds for `state`, a checkpoint.TrainState: values that
    torch.save can write and torch.load(weights_only=True) can read (numbers, strings, lists,
    dicts, tensors).
    """
    return {"step": state.step, "tokens": state.tokens, "best_val_loss": state.best_val_loss, "data": state.data}


def trainer_state_from_dict(saved):
    """The TrainState that `trainer_state_to_dict` saved (`saved` also holds the config and RNG states:
    ignore those here)."""
    return TrainState(step=saved["step"], tokens=saved["tokens"], best_val_loss=saved["best_val_loss"],
                      data=saved["data"])


def rng_state(sample_generator):
    """This process's random number generator states as a dict of values torch.load(weights_only=True)
    accepts: torch's global generator, `sample_generator` (the torch.Generator of the text samples),
    and Python's and NumPy's for anything that draws from them.
    """
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "sample": sample_generator.get_state(), "python": random.getstate(),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss)}


def set_rng_state(state, sample_generator):
    """Put back what `rng_state` saved."""
    torch.set_rng_state(state["torch"])
    sample_generator.set_state(state["sample"])
    random.setstate(state["python"])
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
