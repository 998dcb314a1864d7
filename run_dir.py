"""The run folder (`train.out_dir`): who may write it, and what a fresh start or a resume may do to it.

Before the loop writes anything, `decide_start` locks the folder (`RunLock`: one training per folder), checks that
every rank sees it, and decides on rank 0 where the run starts (`Start`): this run's newest checkpoint, a rewind to
`checkpoint.resume_step`, or a fresh start (from scratch or `checkpoint.load_path`). Every refusal is made then, so a
refused command leaves the folder and the bucket exactly as they were. Once the checkpoint is loaded,
`carry_out_start` carries the Start out on rank 0: a rewind moves newer checkpoints aside, a resume records changed
settings in `config_changes.jsonl` (`config.json` keeps the first config), a fresh start replaces the old record.
"""

import json
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from checkpoint import (MARKER, STEP_DIR, CheckpointError, check_model_shape, check_sharded_metadata, check_weights_fit,
                        code_change_note, find_checkpoints, find_start_checkpoint, read_marker, read_trainer_state,
                        verify_checkpoint)
from config import keys_with_role, parse_duration, parse_mix, secret_keys, with_defaults
from metrics import truncate_jsonl

# A run's record besides checkpoints (a run that replaces it with save_overwrite starts without them).
RECORD_FILES = ("config.json", "metrics.jsonl", "samples.txt", "wandb_id.txt", "rewinds.jsonl", "config_changes.jsonl")
# What makes two runs the same run: a checkpoint cannot be resumed correctly under other values of these.
IDENTITY = keys_with_role("identity")


def run_records(out_dir):
    """What checkpoint.remote_folder mirrors after each upload: the run's record, environment and metrics snapshots."""
    snapshots = sorted(name for name in os.listdir(out_dir) if re.fullmatch(r"metrics_step\d+\.json", name))
    return [os.path.join(out_dir, name) for name in (*RECORD_FILES, "environment.json", *snapshots)]


class RunLock:
    """`<out_dir>/.lock` holds the pid and host of the training that owns the folder."""

    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, ".lock")
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
    """The identity fields of a saved config, each in a canonical form: `8` and `8steps` are the same stage-2 start,
    `shakespeare:6,python:2` and `shakespeare:3,python:1` the same mixture. A field saved without is at its default."""
    config_dict = with_defaults(config_dict)
    values = {key: config_dict.get(key.split(".")[0], {}).get(key.split(".")[1]) for key in IDENTITY}
    if str(values["train.model_module"]).endswith(".py"):  # one file, by a relative path or an absolute one
        values["train.model_module"] = os.path.realpath(values["train.model_module"])
    for key in ("data.mix", "stage2.mix"):
        if values[key]:
            values[key] = [(name, round(share, 12)) for name, share in parse_mix(values[key], key)]
    if values["stage2.start"]:
        values["stage2.start"] = parse_duration(values["stage2.start"], "stage2.start")
    return values


def changed_fields(old, new):
    """{'section.field': (old, new)} for every field that differs (a field saved without: its default), but secrets
    (config.secret_keys) and config_to_dict's note of them: a record holds "***", and a new webhook URL is no change."""
    old, new, changes, secrets = with_defaults(old), with_defaults(new), {}, set(secret_keys())
    for section in sorted((set(old) | set(new)) - {"redacted"}):
        for name in sorted(set(old.get(section, {})) | set(new.get(section, {}))):
            a, b = old.get(section, {}).get(name), new.get(section, {}).get(name)
            if a != b and f"{section}.{name}" not in secrets:
                changes[f"{section}.{name}"] = (a, b)
    return changes


@dataclass
class Start:
    """Where a run starts, decided before anything in the run folder changes (`decide_start`)."""
    path: str | None = None  # the checkpoint to load; None: from scratch
    resumed: bool = False  # from this run's own checkpoint (else fresh, from scratch or checkpoint.load_path)
    rewind_to: int = 0  # checkpoint.resume_step to carry out: newer checkpoints move aside in `carry_out_start`
    rewind_folder: str = ""  # where they go (a rewind that a crash cut short is finished in its own folder)
    fetched: str = ""  # a step<N>.download folder from checkpoint.remote_folder; carry_out_start moves it in place
    replace_bucket: list = field(default_factory=list)  # another run's steps in the bucket, replaced by this run
    notes: list = field(default_factory=list)  # what to print about it


def decide_start(out_dir, checkpoint_cfg, run_config, model, rank, world_size, group, stack):
    """Where this run starts; rank 0 holds the lock while `stack` is open, and a checkpoint's weights must fit `model`
    (the one the run trains). A refusal is one sentence on rank 0; the other ranks stop quietly."""
    if rank == 0:
        stack.enter_context(RunLock(out_dir))  # a second training into out_dir stops here
    check_shared_folder(out_dir, rank, world_size, group)
    return from_rank0(lambda: start_on_rank0(out_dir, checkpoint_cfg, run_config, model), rank, world_size, group)


def from_rank0(work, rank, world_size, group):
    """Rank 0 runs `work` (reading the run folder, verifying checksums: once, not once per rank) and sends its
    result to the others; when it raises, rank 0 says why and the other ranks stop quietly."""
    result = [None, False]
    if rank == 0:
        try:
            result = [work(), False]
        except BaseException:
            if world_size > 1:
                dist.broadcast_object_list([None, True], src=0, group=group)
            raise
    if world_size > 1:
        dist.broadcast_object_list(result, src=0, group=group)
    if result[1]:
        sys.exit(2)  # rank 0 printed the reason
    return result[0]


def start_on_rank0(out_dir, checkpoint_cfg, run_config, model):
    """Rank 0, before the run writes anything: the Start of this run, or one sentence that refuses it. Every check is
    here: a rewind to a step without a checkpoint, changed `identity` fields (config.py declares them), weights that do
    not fit `model`, a load_path of another model shape, a folder or a bucket that holds another run (unless
    `checkpoint.save_overwrite`, which replaces it whole)."""
    c = checkpoint_cfg
    bucket_steps, same_run = [], True
    if c.remote_folder:  # (remote_start.py)
        from remote_start import read_bucket
        bucket_steps, same_run = read_bucket(c, out_dir, run_config, identity_difference)
    rewind_to, rewind_folder, rewind_note = 0, "", ""
    if c.resume_step:  # (rewind.py)
        from lab.rewind import plan_rewind
        rewind_to, rewind_folder, rewind_note = plan_rewind(out_dir, c.resume_step, c.rewind_number, bucket_steps)
    fetched = None
    if bucket_steps and same_run and c.load != "never":
        from remote_start import fetch_from_bucket
        fetched = fetch_from_bucket(out_dir, c.remote_folder, bucket_steps, rewind_to)
    try:
        start = checked_start(out_dir, c, run_config, model, rewind_to, fetched)
        if bucket_steps and (not same_run or not start.resumed):  # a fresh start, or another run: replaced whole
            from remote_start import replace_bucket_note
            start.notes.append(replace_bucket_note(c, bucket_steps))
            start.replace_bucket = bucket_steps
    except BaseException:
        if fetched:  # refused: the download goes, and the folder is as it was
            shutil.rmtree(fetched, ignore_errors=True)
        raise
    start.rewind_folder, start.notes = rewind_folder, [n for n in (rewind_note, *start.notes) if n]
    return start


def checked_start(out_dir, c, run_config, model, rewind_to, fetched):
    """The Start, once the rewind is planned and the bucket's checkpoint fetched, with every check made."""
    if rewind_to:
        path, resuming, note = dict(find_checkpoints(out_dir)).get(rewind_to, fetched), True, ""
        verify_checkpoint(path)
    elif fetched:  # its files passed their checksums as they came; an FSDP run's .metadata is checked as data now
        check_sharded_metadata(fetched, read_marker(fetched)["files"])
        path, resuming, note = fetched, True, f"note: {out_dir} had no checkpoint as new as {c.remote_folder}'s newest"
    else:
        path, resuming, note = find_start_checkpoint(out_dir, c.load, c.load_path)
    saved = read_trainer_state(path)["config"] if resuming else None
    # save_overwrite replaces a different run, but never one being rewound (that would do both): refused below
    if resuming and c.save_overwrite and not rewind_to and identity(saved) != identity(run_config):
        if fetched:
            shutil.rmtree(fetched, ignore_errors=True)
            fetched = None
        path, resuming, note = find_start_checkpoint(out_dir, c.load, c.load_path, ignore_own=True)
        replacing = (f"note: replacing the different run in train.out_dir={out_dir} (checkpoint.save_overwrite); its "
                     f"checkpoints go once this run has one")
        note = "\n".join(filter(None, [note, replacing]))
    ours = path and os.path.exists(os.path.join(path, MARKER))  # else GPT-2's weights (hf.py checks those)
    if resuming:
        check_identity(out_dir, saved, run_config)
        check_weights_fit(path, model, f"train it in a new train.out_dir, or replace the run in {out_dir} with "
                                       f"--checkpoint.load=never --checkpoint.save_overwrite=true.")
    else:
        check_fresh_start(out_dir, run_config, c.save_overwrite)
        if ours:
            check_model_shape(read_trainer_state(path)["config"]["model"], run_config["model"], path)
            check_weights_fit(path, model, "give checkpoint.load_path a checkpoint of this model, or leave it "
                                           "empty to train from scratch.")
    # Weights that fit may still meet other code (QK-norm adds none): said, and the run goes on.
    saved_code = read_trainer_state(path).get("model_code") if resuming or ours else None
    changed_code = code_change_note(saved_code, run_config["train"]["model_module"], path)
    return Start(path, resuming, rewind_to, fetched=fetched or "", notes=[note, changed_code])


def carry_out_start(out_dir, start, saved_config, run_config, step, checkpoint_cfg, trains=True):
    """Rank 0, once the start is loaded: carry out the Start. Returns the old run's checkpoints, to delete once this
    run's first is complete, and the lines to print. `trains`: False for a resume past its end (no change recorded)."""
    c, lines = checkpoint_cfg, []
    if c.remote_folder:  # (remote_start.py)
        from remote_start import carry_out_in_bucket
        lines.append(carry_out_in_bucket(out_dir, start, c.remote_folder))
    if start.rewind_to:
        from lab.rewind import rewind
        lines.append(rewind(out_dir, start.rewind_to, start.rewind_folder, c.rewind_number))
    replaced = []
    if start.resumed:
        accept_resume(out_dir, saved_config, run_config, step, trains)
    else:
        replaced = claim_for_fresh_start(out_dir, run_config, c.save_overwrite)
    remove_own_partial_saves(out_dir)  # what a crash in the middle of a save left behind
    truncate_jsonl(os.path.join(out_dir, "metrics.jsonl"), after_step=step)  # those steps run again
    lines.append(remove_stale_cancel(out_dir))
    return replaced, [line for line in lines if line]


def identity_difference(saved_config, run_config):
    """None when the configs are one run, else (key, saved value, this run's) of the first identity field to differ."""
    changes = changed_fields(saved_config, run_config)
    saved_identity, run_identity = identity(saved_config), identity(run_config)
    for key in IDENTITY:
        if saved_identity[key] != run_identity[key]:
            return (key, *changes.get(key, (saved_identity[key], run_identity[key])))
    return None


def check_identity(out_dir, saved_config, run_config):
    """Rank 0, deciding the start (before anything is loaded or written): refuse a resume whose identity changed."""
    difference = identity_difference(saved_config, run_config)
    if difference:
        from config_help import as_override
        key, old, new = difference
        gone = key == "train.model_module" and old != "model" and not os.path.isfile(old)  # (moved, or deleted)
        to_resume = f"put that file back at {old} and set {as_override(key, old)}" if gone else \
            f"set {as_override(key, old)}"
        raise CheckpointError(
            f"{out_dir} holds a run with {key}={old!r} and this run has {key}={new!r}, which cannot be resumed "
            f"correctly; {to_resume} to resume it, or start fresh in another train.out_dir (or pass "
            f"--checkpoint.save_overwrite=true to replace it).")


def accept_resume(out_dir, saved_config, run_config, step, trains=True):
    """Rank 0, resuming: note and record every change of a setting that may change (check_identity has
    refused the others), unless the run trains nothing (no step runs under them)."""
    changes = changed_fields(saved_config, run_config)
    if changes and trains:
        print(f"note: resuming at step {step} with changed settings: "
              + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
        with open(os.path.join(out_dir, "config_changes.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "changes": {k: list(v) for k, v in changes.items()}}) + "\n")
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        write_config(out_dir, saved_config)


def check_fresh_start(out_dir, run_config, save_overwrite):
    """A fresh start into a folder that holds another run is refused unless save_overwrite. A run with the
    same identity that never reached a checkpoint simply restarts."""
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    leftovers = sorted(n for n in names if n in RECORD_FILES or STEP_DIR.match(n) or n.startswith("metrics_step"))
    if leftovers and not save_overwrite:
        same_run = False
        if "config.json" in names and not find_checkpoints(out_dir):
            with open(os.path.join(out_dir, "config.json")) as f:
                same_run = identity(json.load(f)) == identity(run_config)
        if not same_run:
            shown = ", ".join(leftovers[:3])
            raise CheckpointError(f"{out_dir} already holds another run ({shown}); resume it, choose "
                                  f"another train.out_dir, or pass --checkpoint.save_overwrite=true to replace it.")


def claim_for_fresh_start(out_dir, run_config, save_overwrite):
    """A fresh start (check_fresh_start first): this run's record replaces the old one's now: its config, an empty
    metrics log (the snapshots go with it) and samples file, and no W&B id (a new W&B run, never the old one
    continued). Returns the old run's checkpoint folders, to delete once this run's first checkpoint is complete."""
    check_fresh_start(out_dir, run_config, save_overwrite)
    checkpoints = [path for _, path in find_checkpoints(out_dir)]
    write_config(out_dir, run_config)
    for name in os.listdir(out_dir):
        snapshot = name.startswith("metrics_step") and name.endswith(".json")
        if (name in RECORD_FILES and name != "config.json") or snapshot:
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
    """Every rank must see the run folder rank 0 writes (checkpoints, CANCEL, the lock): with node-local folders, the
    other nodes would start from step 0 with other weights until a collective times out. Rank 0 writes a token there,
    every rank reads it, and all agree before anyone reads a checkpoint (OLMo-core raises too on an unshared folder)."""
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


def remove_stale_cancel(out_dir):
    """A CANCEL file that exists before this run started was meant for an earlier run: remove it and
    say so, rather than stop this run after its first step. Returns the line to print, or None."""
    path = os.path.join(out_dir, "CANCEL")
    if os.path.exists(path):  # called before the loop starts, so any CANCEL is older than this run
        os.remove(path)
        return f"note: removed {path}, left by an earlier run (touch it again to stop this one)"
    return None
