"""The run folder (`train.out_dir`): who may write it, and what a fresh start or a resume may do to it.

Rank 0 calls these at start-up, in this order, before the loop writes anything:

1. `RunLock`: one training per folder. A second `train.py` into the same folder stops with one
   sentence; a lock left by a crashed run (its process is gone) is taken over with a note.
2. `choose_start`: resume this run's newest checkpoint, or start fresh (from scratch or
   `checkpoint.load_path`). With `checkpoint.save_overwrite` a *different* run in the folder is
   replaced rather than resumed; the same run is still resumed (so a preempted job restarts well).
3. `accept_resume` (resuming): the settings that make a run what it is (model shape, data, seed,
   batch, mixture) must not change, or the run stops with the field's name; other changes (max_steps, LR,
   evaluation, ...) are printed and recorded in `config_changes.jsonl`. `config.json` keeps the
   first config.
   `claim_for_fresh_start` (fresh): a folder holding another run is refused unless save_overwrite.
   When replacing, the old run's record (config, metrics, samples, W&B id) is replaced now, and its
   checkpoints only once the new run's first checkpoint is complete (see `Checkpointer`).
4. `remove_own_partial_saves`: only the exact `step<N>.partial` folders a crashed save of ours left.
"""

import json
import os
import shutil
import socket
import time

import torch

from checkpoint import CheckpointError, choose_checkpoint, find_checkpoints, STEP_DIR

LOCK = ".lock"
RECORD_FILES = ("config.json", "metrics.jsonl", "samples.txt", "wandb_id.txt")  # a run's record besides checkpoints
# What makes two runs the same run: what a checkpoint cannot be resumed correctly without.
IDENTITY = ("model.block_size", "model.vocab_size", "model.n_layer", "model.n_head", "model.n_embd", "model.bias",
            "data.dataset", "data.mix", "data.shuffle", "train.seed", "train.total_batch_size", "stage2.start",
            "stage2.mix", "stage2.reference")


class RunLock:
    """`<out_dir>/.lock` holds the pid and host of the training that owns the folder."""

    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, LOCK)
        self.out_dir = out_dir

    def __enter__(self):
        os.makedirs(self.out_dir, exist_ok=True)
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                owner = self._owner()
                if owner and (owner.get("host") != mine["host"] or pid_alive(owner.get("pid"))):
                    raise CheckpointError(
                        f"{self.out_dir} is in use by another training (pid {owner.get('pid')} on "
                        f"{owner.get('host')}, started {owner.get('started')}); wait for it to end or choose another "
                        f"train.out_dir (if that process is surely gone, delete {self.path}).") from None
                print(f"note: removing the lock of a run that ended without releasing it ({owner})")
                os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            return self
        raise CheckpointError(f"could not take the lock {self.path}; another process keeps creating it, so "
                              f"choose another train.out_dir.")

    def _owner(self):
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None  # being written right now, or damaged: treated as stale

    def __exit__(self, *exc):
        owner = self._owner()
        if owner and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            os.remove(self.path)


def pid_alive(pid):
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def identity(config_dict):
    return {key: config_dict.get(key.split(".")[0], {}).get(key.split(".")[1]) for key in IDENTITY}


def changed_fields(old, new):
    """{'section.field': (old, new)} for every field that differs."""
    changes = {}
    for section in sorted(set(old) | set(new)):
        for name in sorted(set(old.get(section, {})) | set(new.get(section, {}))):
            a, b = old.get(section, {}).get(name), new.get(section, {}).get(name)
            if a != b:
                changes[f"{section}.{name}"] = (a, b)
    return changes


def choose_start(out_dir, checkpoint_cfg, run_config):
    """(path, resuming, note): see choose_checkpoint; with save_overwrite a different run is not resumed."""
    c = checkpoint_cfg
    path, resuming, note = choose_checkpoint(out_dir, c.load, c.load_path)
    if resuming and c.save_overwrite:
        saved = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)["config"]
        if identity(saved) != identity(run_config):
            path, resuming, note = choose_checkpoint(out_dir, c.load, c.load_path, ignore_own=True)
            note = "\n".join(filter(None, [note, f"note: replacing the different run in {out_dir} "
                                                  f"(checkpoint.save_overwrite); its checkpoints go once this run has one"]))
    return path, resuming, note


def accept_resume(out_dir, saved_config, run_config, step):
    """Refuse a resume whose identity changed; note and record any other change."""
    changes = changed_fields(saved_config, run_config)
    for key in IDENTITY:
        if key in changes:
            old, new = changes[key]
            raise CheckpointError(
                f"{out_dir} holds a run with {key}={old!r} and this run has {key}={new!r}, which cannot be resumed "
                f"correctly; set --{key}={old!r} to resume it, or start fresh in another train.out_dir (or pass "
                f"--checkpoint.save_overwrite=true to replace it).")
    if changes:
        print(f"note: resuming at step {step} with changed settings: "
              + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
        with open(os.path.join(out_dir, "config_changes.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "changes": {k: list(v) for k, v in changes.items()}}) + "\n")
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        write_config(out_dir, saved_config)


def claim_for_fresh_start(out_dir, run_config, save_overwrite):
    """Before a fresh start: refuse a folder that holds another run unless save_overwrite. A run with
    the same identity that never reached a checkpoint simply restarts. Returns the old run's checkpoint
    folders, to delete once this run's first checkpoint is complete."""
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    checkpoints = [path for _, path in find_checkpoints(out_dir)]
    leftovers = sorted(n for n in names if n in RECORD_FILES or STEP_DIR.match(n) or n.startswith("metrics_step"))
    if leftovers and not save_overwrite:
        same_run = False
        if "config.json" in names and not checkpoints:
            with open(os.path.join(out_dir, "config.json")) as f:
                same_run = identity(json.load(f)) == identity(run_config)
        if not same_run:
            raise CheckpointError(f"{out_dir} already holds another run ({', '.join(leftovers[:3])}); resume it, choose "
                                  f"another train.out_dir, or pass --checkpoint.save_overwrite=true to replace it.")
    # The new run's record replaces the old one's now: config, an empty metrics log and samples file, and
    # no W&B id (a new W&B run is started, never the old one continued). Snapshots go with their log.
    write_config(out_dir, run_config)
    for name in names:
        if (name in RECORD_FILES and name != "config.json") or (name.startswith("metrics_step") and name.endswith(".json")):
            os.remove(os.path.join(out_dir, name))
    return checkpoints


def write_config(out_dir, run_config):
    tmp = os.path.join(out_dir, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(run_config, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "config.json"))


def remove_own_partial_saves(out_dir):
    """Delete the `step<N>.partial` folders an interrupted save of this project left (nothing else)."""
    for name in os.listdir(out_dir):
        if name.endswith(".partial") and STEP_DIR.match(name[: -len(".partial")]):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)


def remove_stale_cancel(out_dir):
    """A CANCEL file that exists before this run started was meant for an earlier run: remove it and
    say so, rather than stop this run after its first step. Returns the line to print, or None."""
    path = os.path.join(out_dir, "CANCEL")
    if os.path.exists(path):  # called before the loop starts, so any CANCEL is older than this run
        os.remove(path)
        return f"note: removed {path}, left by an earlier run (touch it again to stop this one)"
    return None
