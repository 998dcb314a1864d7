"""The GPT class of a .py file of your own, which train.model_module names (the course's capstone
trains a student's GPT this way), and what the trainer asks every model. A module of its own because
only that setting loads a file: checkpoint.gpt_class hands it the path, so a run with model.py's GPT
never reads this.

A file is imported only when the user names it (train.model_module in this command or a .py
config file, a tool's --model_module), never because a checkpoint or a saved config.json names it,
and never from a checkpoint folder or the bucket's download cache: files from outside are data,
not code.
"""

import importlib.util
import os

from checkpoint_folder import MARKER

# What the rest of the trainer asks of every GPT class; model.py's methods fit any GPT built of the
# same parts.
WHAT_THE_TRAINER_ASKS = ("forward", "logits", "score_tokens", "blocks", "param_groups",
                         "param_kinds", "num_params",
                         "num_params_with_output", "flops_per_token")


def load_gpt_class(module):
    """The class GPT defined in the file `module`, which must have every attribute in
    WHAT_THE_TRAINER_ASKS; a wrong path, or a file without that class or those attributes, is one
    sentence that says what to do."""
    if not module.endswith(".py"):
        raise ValueError(f"train.model_module={module!r} is neither model nor a .py file; give the "
                         "path of the file that defines your GPT class.")
    if not os.path.isfile(module):  # (a run saved with it names it: moved or deleted since)
        raise ValueError(f"train.model_module={module!r} is no file (moved or deleted?); put the "
                         "file that defines your GPT class at that path.")
    check_not_from_outside(module)
    module_name = os.path.splitext(os.path.basename(module))[0]
    spec = importlib.util.spec_from_file_location(module_name, module)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    if not hasattr(loaded, "GPT"):
        raise ValueError(f"{module} defines no class GPT; name your model class GPT.")
    missing = [name for name in WHAT_THE_TRAINER_ASKS if not hasattr(loaded.GPT, name)]
    if missing:
        raise ValueError(f"{module}'s GPT has no {', '.join(missing)}, which the trainer asks "
                         "every model; give it model.py's (e.g. `param_groups = "
                         "model.GPT.param_groups`).")
    return loaded.GPT


def check_not_from_outside(module):
    """A ValueError when the file `module` lies inside a checkpoint folder (one that holds a
    COMPLETE marker) or the cache of checkpoints downloaded from a bucket: whoever handed the
    checkpoint over wrote it."""
    from lab.remote import cache_folder

    path, cache = os.path.realpath(module), os.path.realpath(cache_folder())
    folder = os.path.dirname(path)
    while True:
        if os.path.isfile(os.path.join(folder, MARKER)) or folder == cache:
            raise ValueError(f"{module} lies inside {folder}, a checkpoint folder or the download "
                             "cache, whose files are data and never imported; copy the file you "
                             "trust elsewhere and name that copy.")
        if os.path.dirname(folder) == folder:
            return
        folder = os.path.dirname(folder)


