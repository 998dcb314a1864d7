"""The run folder (`train.out_dir`): who may write it, and what a fresh start or a resume may do to it.

Rank 0 calls these at start-up, in this order, before the loop writes anything:

1. `RunLock`: one training per folder. A second `train.py` into the same folder stops with one
   sentence; a lock left by a crashed run (its process is gone) is taken over with a note.
2. `choose_start`: resume this run's newest checkpoint, or start fresh (from scratch or
   `checkpoint.load_path`). With `checkpoint.save_overwrite` a *different* run in the folder is
   replaced rather than resumed; the same run is still resumed (so a preempted job restarts well).
3. `check_identity` (resuming, every rank, before the checkpoint is loaded): the settings that make a
   run what it is (model shape, data, seed, batch, mixture, optimizer) must not change, or the run
   stops with the field's name. `accept_resume` (rank 0): other changes (max_steps, LR, evaluation,
   ...) are printed and recorded in `config_changes.jsonl`. `config.json` keeps the
   first config.
   `claim_for_fresh_start` (fresh): a folder holding another run is refused unless save_overwrite.
   When replacing, the old run's record (config, metrics, samples, W&B id) is replaced now, and its
   checkpoints only once the new run's first checkpoint is complete (see `Checkpointer`).
4. `remove_own_partial_saves`: only the exact `step<N>.partial` folders a crashed save of ours left.
"""

import json
import os
import re
import shutil
import socket
import time


from checkpoint import STEP_DIR, CheckpointError, choose_checkpoint, find_checkpoints, read_trainer_state
from config import Config, as_override, config_to_dict, parse_duration, parse_mix

LOCK = ".lock"
RECORD_FILES = ("config.json", "metrics.jsonl", "samples.txt", "wandb_id.txt")  # a run's record besides checkpoints
# What makes two runs the same run: what a checkpoint cannot be resumed correctly without.
IDENTITY = ("model.block_size", "model.vocab_size", "model.n_layer", "model.n_head", "model.n_embd", "model.bias",
            "data.dataset", "data.mix", "data.shuffle", "train.seed", "train.total_batch_size", "stage2.start",
            "stage2.mix", "stage2.reference", "optim.name")


class RunLock:
    """`<out_dir>/.lock` holds the pid and host of the training that owns the folder."""

    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, LOCK)
        self.out_dir = out_dir

    def __enter__(self):
        self.created = not os.path.exists(self.out_dir)  # a run that fails at start leaves no empty folder behind
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            probe = os.path.join(self.out_dir, f".writable.{os.getpid()}")
            open(probe, "w").close()
            os.remove(probe)
        except OSError as error:  # a read-only filesystem, no permission, a file in the way: before anything is written
            raise CheckpointError(f"cannot write in train.out_dir={self.out_dir} ({error.strerror or error}); choose "
                                  f"a folder you can write to.") from None
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
        if self.created and os.path.isdir(self.out_dir) and not os.listdir(self.out_dir):
            os.rmdir(self.out_dir)


def pid_alive(pid):
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def identity(config_dict):
    """The identity fields of a saved config, each in a canonical form: `8` and `8steps` are the same
    stage-2 start, `shakespeare:6,python:2` and `shakespeare:3,python:1` the same mixture."""
    config_dict = with_defaults(config_dict)
    values = {key: config_dict.get(key.split(".")[0], {}).get(key.split(".")[1]) for key in IDENTITY}
    for key in ("data.mix", "stage2.mix"):
        if values[key]:
            values[key] = [(name, round(share, 12)) for name, share in parse_mix(values[key], key)]
    if values["stage2.start"]:
        values["stage2.start"] = parse_duration(values["stage2.start"], "stage2.start")
    return values


def changed_fields(old, new):
    """{'section.field': (old, new)} for every field that differs. A field that `old` (a config saved by
    an earlier version) lacks had its default then: it counts as the default (optim.name: adamw)."""
    old = with_defaults(old)
    changes = {}
    for section in sorted(set(old) | set(new)):
        for name in sorted(set(old.get(section, {})) | set(new.get(section, {}))):
            a, b = old.get(section, {}).get(name), new.get(section, {}).get(name)
            if a != b:
                changes[f"{section}.{name}"] = (a, b)
    return changes


def with_defaults(saved):
    """A saved config with the fields it lacks filled in from today's defaults."""
    defaults = config_to_dict(Config())
    return {section: {**defaults.get(section, {}), **values} if isinstance(values, dict) else values
            for section, values in {**defaults, **saved}.items()}


def choose_start(out_dir, checkpoint_cfg, run_config):
    """(path, resuming, note): see choose_checkpoint; with save_overwrite a different run is not resumed."""
    c = checkpoint_cfg
    path, resuming, note = choose_checkpoint(out_dir, c.load, c.load_path)
    if resuming and c.save_overwrite:
        saved = read_trainer_state(path)["config"]
        if identity(saved) != identity(run_config):
            path, resuming, note = choose_checkpoint(out_dir, c.load, c.load_path, ignore_own=True)
            note = "\n".join(filter(None, [note, f"note: replacing the different run in {out_dir} "
                                                  f"(checkpoint.save_overwrite); its checkpoints go once this run has one"]))
    return path, resuming, note


def check_identity(out_dir, saved_config, run_config):
    """Every rank, before a checkpoint is loaded: refuse a resume whose identity changed."""
    changes = changed_fields(saved_config, run_config)
    saved_identity, run_identity = identity(saved_config), identity(run_config)
    for key in IDENTITY:
        if saved_identity[key] != run_identity[key]:
            old, new = changes[key]
            raise CheckpointError(
                f"{out_dir} holds a run with {key}={old!r} and this run has {key}={new!r}, which cannot be resumed "
                f"correctly; set {as_override(key, old)} to resume it, or start fresh in another train.out_dir (or "
                f"pass --checkpoint.save_overwrite=true to replace it).")


def accept_resume(out_dir, saved_config, run_config, step):
    """Rank 0, resuming: note and record every change of a setting that may change (check_identity has
    refused the others)."""
    changes = changed_fields(saved_config, run_config)
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


def check_shared_folder(out_dir, rank, world_size, group=None):
    """Every rank must see the run folder rank 0 writes (checkpoints, CANCEL, the lock): with node-local
    folders, the other nodes would start from step 0 with other weights until a collective times out.
    Rank 0 writes a token there, every rank reads it, and all agree before anyone reads a checkpoint
    (OLMo-core raises too when the save folder is not shared)."""
    import torch.distributed as dist

    if world_size == 1:
        return
    path = os.path.join(out_dir, ".shared_folder_check")
    token = [f"{socket.gethostname()}:{os.getpid()}:{time.time()}" if rank == 0 else None]
    if rank == 0:
        with open(path, "w") as f:
            f.write(token[0])
    dist.broadcast_object_list(token, src=0, group=group)
    try:
        with open(path) as f:
            seen = f.read() == token[0]
    except OSError:
        seen = False
    blind = [None] * world_size
    dist.all_gather_object(blind, None if seen else f"{rank} on {socket.gethostname()}", group=group)
    blind = [b for b in blind if b is not None]
    dist.barrier(group=group)
    if rank == 0:
        os.remove(path)
    if blind:
        raise CheckpointError(f"rank(s) {', '.join(blind)} do not see the files rank 0 writes in "
                              f"train.out_dir={out_dir}: every node must reach the run folder on one shared "
                              f"filesystem (an NFS or Lustre path, not a node-local disk); set train.out_dir to one.")


def rewind(out_dir, step):
    """checkpoint.resume_step: make `step<step>` this run's newest checkpoint by moving every newer
    checkpoint, and the metrics past that step, into out_dir/rewound/<time>_to_step<step>/ (OLMo's
    "restart from an earlier checkpoint after a loss spike"). Nothing is deleted, and the rewind is
    recorded in rewinds.jsonl; running the same command again later (a preempted job that restarts)
    resumes normally instead of rewinding twice. Returns the line to print, or ""."""
    found = dict(find_checkpoints(out_dir))
    if step not in found:
        have = ", ".join(map(str, sorted(found))) or "none"
        raise CheckpointError(f"checkpoint.resume_step={step} but {out_dir} has no complete checkpoint at step {step} "
                              f"(it has: {have}); pick one of those.")
    log_path = os.path.join(out_dir, "rewinds.jsonl")
    done = [json.loads(line) for line in open(log_path)] if os.path.exists(log_path) else []
    if done and done[-1]["to_step"] == step:
        return f"note: already rewound to step {step} ({done[-1]['time']}); resuming as usual"
    newer = sorted(s for s in found if s > step)
    if not newer:
        return ""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = os.path.join(out_dir, "rewound", f"{stamp}_to_step{step}")
    os.makedirs(folder)
    for s in newer:
        os.replace(found[s], os.path.join(folder, f"step{s}"))
    for name in os.listdir(out_dir):  # per-evaluation snapshots past the step go with their checkpoints
        match = re.fullmatch(r"metrics_step(\d+)\.json", name)
        if match and int(match.group(1)) > step:
            os.replace(os.path.join(out_dir, name), os.path.join(folder, name))
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        shutil.copy2(metrics_path, os.path.join(folder, "metrics.jsonl"))  # the whole log, as it was
    link = os.path.join(out_dir, "latest")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(f"step{step}", link)
    with open(log_path, "a") as f:
        f.write(json.dumps({"time": stamp, "to_step": step, "moved_steps": newer, "folder": folder}) + "\n")
    return (f"rewound to step {step}: checkpoints {', '.join(map(str, newer))} and the metrics after step {step} are "
            f"in {folder}")


def remove_stale_cancel(out_dir):
    """A CANCEL file that exists before this run started was meant for an earlier run: remove it and
    say so, rather than stop this run after its first step. Returns the line to print, or None."""
    path = os.path.join(out_dir, "CANCEL")
    if os.path.exists(path):  # called before the loop starts, so any CANCEL is older than this run
        os.remove(path)
        return f"note: removed {path}, left by an earlier run (touch it again to stop this one)"
    return None
