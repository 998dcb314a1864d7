"""Where a run starts when `checkpoint.remote_folder` is set: whether the bucket holds this run, the checkpoint to
download from it, the refusal to mix two runs there, and the bucket's part of carrying the start out. run_dir.py
imports this module only then.

A module of its own, not part of remote.py, because these checks read the run folder through checkpoint.py,
which imports remote.py; run_dir.py passes in its `identity_difference`, as run_dir.py imports this module.
"""

import json
import os

from lab import remote
from checkpoint import STEP_DIR, CheckpointError, find_checkpoints, newest_valid_checkpoint
from config_help import as_override


def read_bucket(c, out_dir, run_config, identity_difference):
    """checkpoint.remote_folder's complete checkpoint steps, and whether the run there is this one (the same
    identity fields; an empty bucket folder is anyone's). Another run is refused unless save_overwrite; the run of
    out_dir itself, given another identity setting, is refused as a resume of out_dir would be."""
    url = c.remote_folder
    saved, steps = remote.read_run(url)
    if saved is None and not steps:
        return steps, True
    difference = identity_difference(saved, run_config) if saved is not None else ("its config", "unreadable", "")
    own = os.path.join(out_dir, "config.json")
    if difference and saved is not None and os.path.exists(own):
        with open(own) as f:
            ours = json.load(f)
        if not identity_difference(ours, saved):  # the bucket holds this folder's run: a setting changed
            key, old, new = difference
            raise CheckpointError(f"{out_dir} and checkpoint.remote_folder={url} hold a run with {key}={old!r} and "
                                  f"this run has {key}={new!r}, which cannot be resumed correctly; set "
                                  f"{as_override(key, old)} to resume it, or start fresh in another train.out_dir "
                                  f"and remote folder.")
    if difference and not c.save_overwrite:
        key, old, new = difference
        raise CheckpointError(f"checkpoint.remote_folder={url} holds another run ({key}={old!r} there, {new!r} "
                              f"here); give this run another remote folder, or pass --checkpoint.save_overwrite=true "
                              f"to replace that run there.")
    return steps, not difference


def fetch_from_bucket(out_dir, url, bucket_steps, rewind_to):
    """checkpoint.remote_folder: the checkpoint to resume from, downloaded into `step<N>.download`, or None: the
    bucket's newest when out_dir has no valid checkpoint as new (a fresh node after a preemption), or with a rewind
    to a step only the bucket has, that step."""
    own = newest_valid_checkpoint(out_dir)
    own_step = int(STEP_DIR.match(os.path.basename(own)).group(1)) if own else -1
    if rewind_to:
        wanted = [] if rewind_to in {s for s, _ in find_checkpoints(out_dir)} else [rewind_to]
    else:
        wanted = [s for s in reversed(bucket_steps) if s > own_step]
    return remote.download_newest(url, wanted, out_dir, fall_back=not rewind_to)


def replace_bucket_note(c, bucket_steps):
    """A fresh start, or another run, with checkpoints in the bucket: refused (it would mix two runs there) unless
    save_overwrite, which replaces that run whole. Returns the note to print."""
    if not c.save_overwrite:
        raise CheckpointError(f"checkpoint.remote_folder={c.remote_folder} holds checkpoints "
                              f"({steps_text(bucket_steps)}) and this run starts afresh, which "
                              f"would mix two runs there; resume them (checkpoint.load=if_available), give "
                              f"another remote folder, or pass --checkpoint.save_overwrite=true.")
    return (f"note: replacing the run in {c.remote_folder} (checkpoint.save_overwrite): its checkpoints go once this "
            f"run's first is uploaded")


def carry_out_in_bucket(out_dir, start, url):
    """carry_out_start's part in the bucket, before the folder's: a downloaded checkpoint becomes the folder's own,
    and a rewind moves the bucket's newer steps aside (first: a restart must not download what goes aside). Returns
    the line to print, or None."""
    line = None
    if start.fetched:
        start.path, line = remote.install_download(out_dir, start.fetched, url)
    if start.rewind_to:
        remote.rewind(url, start.rewind_to, os.path.basename(start.rewind_folder)[: -len(".partial")])
    return line


def steps_text(steps):
    """`steps 4, 6, 8`, or with more than three `5 steps: 2, ..., 6, 8, 10` (a long list would bury the sentence)."""
    if len(steps) <= 3:
        return f"steps {', '.join(map(str, steps))}"
    return f"{len(steps)} steps: {steps[0]}, ..., {', '.join(map(str, steps[-3:]))}"
