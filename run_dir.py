"""The run folder (`train.out_dir`) and where a run starts: who may write the folder, what a fresh
start or a resume may do to it, and the checkpoint the run starts from.

Before the loop writes anything, `decide_start` locks the folder (`RunLock`: one training per
folder), checks that every rank sees it, and decides on rank 0 where the run starts (`Start`): this
run's newest checkpoint (or the bucket's, with checkpoint.remote_folder), a rewind to
`checkpoint.resume_step`, or a fresh start (from scratch or `checkpoint.load_path`). Every refusal
is made then, so a refused command leaves the folder and the bucket exactly as they were.
`load_start` loads the checkpoint, then `carry_out_start` carries the Start out on rank 0: a rewind
moves newer checkpoints aside, a resume records changed settings in `config_changes.jsonl`
(`config.json` keeps the first config), a fresh start replaces the old record. Last, each rank's
pid file and stack dump, which `python lab/debug.py stacks RUN` reads.
"""

import faulthandler
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from checkpoint import (CheckpointError, TrainState, check_model_shape, check_sharded_metadata,
                        check_source, check_weights_fit, code_change_note, code_changes,
                        load_checkpoint, model_code, newest_valid_checkpoint, read_trainer_state,
                        verify_checkpoint)
from checkpoint_folder import MARKER, STEP_DIR, find_checkpoints, newest_checkpoint, read_marker
from config import (ConfigError, keys_with_role, parse_duration, parse_mix, redact_argv,
                    secret_keys, with_defaults)
from data import dataset_dir, fingerprint
from metrics import metrics_snapshots, truncate_jsonl
from plan import shares_text

# A run's record besides checkpoints (a run that replaces it with save_overwrite starts without
# them).
RECORD_FILES = ("config.json", "metrics.jsonl", "samples.txt", "wandb_id.txt", "rewinds.jsonl",
                "config_changes.jsonl")

# What makes two runs the same run: a checkpoint cannot be resumed correctly under other values of
# these.
IDENTITY = keys_with_role("identity")

def run_records(out_dir):
    """What checkpoint.remote_folder mirrors after each upload: the run's record, environment and
    metrics snapshots."""
    snapshots = [path for _, path in sorted(metrics_snapshots(out_dir).items())]
    return [os.path.join(out_dir, name) for name in (*RECORD_FILES, "environment.json")] + snapshots


# What produced the run (environment.json, beside config.json): the code version, the software
# and the hardware.


def save_environment(out_dir, world_size):
    """What produced this run, beside config.json: the code version, the software, the hardware."""
    repo = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    env = {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "command": redact_argv(sys.argv),  # a secret on the command line is "***"
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "host": socket.gethostname(),
        "world_size": world_size,
    }
    with open(os.path.join(out_dir, "environment.json"), "w") as f:
        json.dump(env, f, indent=2)


class RunLock:
    """`<out_dir>/.lock` holds the pid and host of the training that owns the folder."""

    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, ".lock")
        self.out_dir = out_dir

    def __enter__(self):
        # a run that fails at start leaves no empty folder behind
        self.created = not os.path.exists(self.out_dir)
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            probe = os.path.join(self.out_dir, f".writable.{os.getpid()}")
            open(probe, "w").close()
            os.remove(probe)
        except OSError as error:  # read-only, no permission, a file in the way: before any write
            raise CheckpointError(f"cannot write in train.out_dir={self.out_dir} "
                                  f"({error.strerror or error}); choose a folder you can write "
                                  "to.") from None
        mine = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                owner = self._owner()
                if owner and (owner.get("host") != mine["host"] or pid_alive(owner.get("pid"))):
                    raise CheckpointError(
                        f"{self.out_dir} is in use by another training (pid {owner.get('pid')} on "
                        f"{owner.get('host')}, started {owner.get('started')}); wait for it to end "
                        "or choose another train.out_dir (if that process is surely gone, delete "
                        f"{self.path}).") from None
                print(f"note: removing the lock of a run that ended without releasing it ({owner})")
                os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            return self
        raise CheckpointError(f"could not take the lock {self.path}; another process keeps "
                              "creating it, so choose another train.out_dir.")

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


def identity_of(config_dict):
    """The identity fields of a saved config, each in a canonical form: `8` and `8steps` are the
    same stage-2 start, `shakespeare:6,python:2` and `shakespeare:3,python:1` the same mixture. A
    field saved without is at its default."""
    config_dict = with_defaults(config_dict)
    values = {key: config_dict.get(key.split(".")[0], {}).get(key.split(".")[1])
              for key in IDENTITY}
    # one file, by a relative path or an absolute one
    if str(values["train.model_module"]).endswith(".py"):
        values["train.model_module"] = os.path.realpath(values["train.model_module"])
    for key in ("data.mix", "stage2.mix"):
        if values[key]:
            values[key] = [(name, round(share, 12)) for name, share in parse_mix(values[key], key)]
    if values["stage2.start"]:
        values["stage2.start"] = parse_duration(values["stage2.start"], "stage2.start")
    return values


def changed_fields(old, new):
    """{'section.field': (old, new)} for every field that differs (a field saved without: its
    default), but secrets (config.secret_keys) and config_to_dict's note of them: a record holds
    "***", and a new webhook URL is no change."""
    old, new, changes, secrets = with_defaults(old), with_defaults(new), {}, set(secret_keys())
    for section in sorted((set(old) | set(new)) - {"redacted"}):
        for name in sorted(set(old.get(section, {})) | set(new.get(section, {}))):
            a, b = old.get(section, {}).get(name), new.get(section, {}).get(name)
            if a != b and f"{section}.{name}" not in secrets:
                changes[f"{section}.{name}"] = (a, b)
    return changes


def identity_difference(saved_config, run_config):
    """None when the configs are one run, else (key, saved value, this run's) of the first identity
    field to differ."""
    changes = changed_fields(saved_config, run_config)
    saved_identity, run_identity = identity_of(saved_config), identity_of(run_config)
    for key in IDENTITY:
        if saved_identity[key] != run_identity[key]:
            return (key, *changes.get(key, (saved_identity[key], run_identity[key])))
    return None


def as_override(key, value):
    """The command-line override that sets `key` to `value`: --data.mix=shakespeare:3,python:1."""
    if isinstance(value, list):
        value = ",".join(map(str, value))
    elif isinstance(value, bool):
        value = str(value).lower()
    return f"--{key}={value}"


# ----------------------------------------------------------------------------- where a run starts
# Decided on rank 0, before anything is written.


@dataclass
class Start:
    """Where a run starts, decided before anything in the run folder changes (`decide_start`)."""
    path: str | None = None  # the checkpoint to load; None: from scratch
    # from this run's own checkpoint (else fresh, from scratch or checkpoint.load_path)
    resumed: bool = False
    # checkpoint.resume_step to carry out: newer checkpoints move aside in `carry_out_start`
    rewind_to: int = 0
    # where they go (a rewind that a crash cut short is finished in its own folder)
    rewind_folder: str = ""
    # a step<N>.download folder from checkpoint.remote_folder; carry_out_start moves it in place
    fetched: str = ""
    # another run's steps in the bucket, replaced by this run
    replace_bucket: list = field(default_factory=list)
    notes: list = field(default_factory=list)  # what to print about it
    # {file: (hash saved, hash now)}: model code a resume runs, changed since the checkpoint
    code_changes: dict = field(default_factory=dict)


def decide_start(out_dir, checkpoint_cfg, run_config, model, place, stack):
    """Where this run starts; rank 0 holds the lock while `stack` is open, and a checkpoint's
    weights must fit `model` (the one the run trains). A refusal is one sentence on rank 0; the
    other ranks stop quietly."""
    if place.rank == 0:
        stack.enter_context(RunLock(out_dir))  # a second training into out_dir stops here
    check_shared_folder(out_dir, place.rank, place.world_size, place.cpu_group)
    return from_rank0(lambda: start_on_rank0(out_dir, checkpoint_cfg, run_config, model),
                      place.rank, place.world_size, place.cpu_group)


def from_rank0(work, rank, world_size, group):
    """Rank 0 runs `work` (reading the run folder, verifying checksums: once, not once per rank) and
    sends its result to the others; when it raises, rank 0 says why and the other ranks stop
    quietly."""
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
    """Rank 0, before the run writes anything: the Start of this run, or one sentence that refuses
    it. Every check is here: a rewind to a step without a checkpoint, changed `identity` fields
    (config.py declares them), weights that do not fit `model`, a load_path of another model shape,
    a folder or a bucket that holds another run (unless `checkpoint.save_overwrite`, which replaces
    it whole)."""
    c = checkpoint_cfg
    bucket_steps, same_run = [], True
    if c.remote_folder:
        bucket_steps, same_run = read_bucket(c, out_dir, run_config)
    rewind_to, rewind_folder, rewind_note = 0, "", ""
    if c.resume_step:
        from lab.rewind import plan_rewind
        rewind_to, rewind_folder, rewind_note = plan_rewind(out_dir, c.resume_step,
                                                            c.rewind_number, bucket_steps)
    fetched = None
    if bucket_steps and same_run and c.load != "never":
        fetched = fetch_from_bucket(out_dir, c.remote_folder, bucket_steps, rewind_to)
    try:
        start = checked_start(out_dir, c, run_config, model, rewind_to, fetched)
        # a fresh start, or another run: replaced whole
        if bucket_steps and (not same_run or not start.resumed):
            start.notes.append(replace_bucket_note(c, bucket_steps))
            start.replace_bucket = bucket_steps
    except BaseException:
        if fetched:  # refused: the download goes, and the folder is as it was
            shutil.rmtree(fetched, ignore_errors=True)
        raise
    start.rewind_folder, start.notes = rewind_folder, [n for n in (rewind_note, *start.notes) if n]
    return start


def checked_start(out_dir, c, run_config, model, rewind_to, fetched):
    """The Start, once the rewind is planned and the bucket's checkpoint fetched, with every check
    made."""
    if rewind_to:
        path, resuming, note = dict(find_checkpoints(out_dir)).get(rewind_to, fetched), True, ""
        verify_checkpoint(path)
    elif fetched:  # checked as it came; an FSDP run's .metadata is checked as data now
        check_sharded_metadata(fetched, read_marker(fetched)["files"])
        path, resuming = fetched, True
        note = f"note: {out_dir} had no checkpoint as new as {c.remote_folder}'s newest"
    else:
        path, resuming, note = find_start_checkpoint(out_dir, c.load, c.load_path)
    saved = read_trainer_state(path)["config"] if resuming else None
    # save_overwrite replaces a different run, but never one being rewound (that would do both):
    # refused below
    other_run = resuming and identity_of(saved) != identity_of(run_config)
    if other_run and c.save_overwrite and not rewind_to:
        if fetched:
            shutil.rmtree(fetched, ignore_errors=True)
            fetched = None
        path, resuming, note = find_start_checkpoint(out_dir, c.load, c.load_path, ignore_own=True)
        replacing = (f"note: replacing the different run in train.out_dir={out_dir} "
                     "(checkpoint.save_overwrite); its checkpoints go once this run has one")
        note = "\n".join(filter(None, [note, replacing]))
    # else GPT-2's weights (lab/hf.py checks those)
    ours = path and os.path.exists(os.path.join(path, MARKER))
    if resuming:
        check_identity(out_dir, saved, run_config)
        check_weights_fit(path, model, "train it in a new train.out_dir, or replace the run in "
                                       f"{out_dir} with --checkpoint.load=never "
                                       "--checkpoint.save_overwrite=true.")
    else:
        check_fresh_start(out_dir, run_config, c.save_overwrite)
        if ours:
            saved_model = read_trainer_state(path)["config"]["model"]
            check_model_shape(saved_model, run_config["model"], path)
            check_weights_fit(path, model, "give checkpoint.load_path a checkpoint of this model, "
                                           "or leave it empty to train from scratch.")
    # Weights that fit may still meet other code (QK-norm adds none): said, and the run goes on.
    saved_code = read_trainer_state(path).get("model_code") if resuming or ours else None
    module = run_config["train"]["model_module"]
    changed_code = code_change_note(saved_code, module, path)
    return Start(path, resuming, rewind_to, fetched=fetched or "", notes=[note, changed_code],
                 code_changes=code_changes(saved_code, module) if resuming else {})


def find_start_checkpoint(out_dir, load, load_path, ignore_own=False):
    """(path, resuming: path is out_dir's own, note to print or ""). `load`: if_available resumes
    out_dir's own, else starts from load_path (which must hold weights: never a silent start from
    scratch), else from scratch; always requires one; never starts fresh. As in OLMo-core, the run's
    own wins (a restarted fine-tune resumes)."""
    if load == "never":
        return None, False, ""
    if "://" in load_path:  # a bucket (lab/remote.py): downloaded once, into a cache
        from lab import remote
        load_path = remote.local_copy(load_path, "checkpoint.load_path")
    own = None if ignore_own else newest_valid_checkpoint(out_dir)
    if own:
        source = read_trainer_state(own)["config"]["checkpoint"].get("load_path")
        changed = ""
        if source and source != load_path:
            changed = f" (this run started from checkpoint.load_path={source})"
        ignored = (f"note: checkpoint.load_path={load_path} is ignored because {out_dir} has its "
                   f"own checkpoint{changed}")
        return own, True, ignored if load_path else ""
    if load_path:
        from lab.hf import is_gpt2_source
        # fine-tuning GPT-2
        if not os.path.exists(os.path.join(load_path, MARKER)) and is_gpt2_source(load_path):
            note = f"note: starting from the weights of {load_path} (step 0, a fresh optimizer)"
            return load_path, False, note
        return check_source(load_path, "checkpoint.load_path"), False, ""
    if load == "always":
        raise CheckpointError(f"checkpoint.load=always but {out_dir} holds no complete checkpoint "
                              "and checkpoint.load_path is empty; set checkpoint.load_path or use "
                              "load=if_available.")
    return None, False, ""


def check_identity(out_dir, saved_config, run_config):
    """Rank 0, deciding the start (before anything is loaded or written): refuse a resume whose
    identity changed."""
    difference = identity_difference(saved_config, run_config)
    if difference:
        key, old, new = difference
        # (moved, or deleted)
        gone = key == "train.model_module" and old != "model" and not os.path.isfile(old)
        to_resume = f"put that file back at {old} and set {as_override(key, old)}" if gone else \
            f"set {as_override(key, old)}"
        raise CheckpointError(
            f"{out_dir} holds a run with {key}={old!r} and this run has {key}={new!r}, which "
            f"cannot be resumed correctly; {to_resume} to resume it, or start fresh in another "
            "train.out_dir (or pass --checkpoint.save_overwrite=true to replace it).")


def check_fresh_start(out_dir, run_config, save_overwrite):
    """A fresh start into a folder that holds another run is refused unless save_overwrite. A run
    with the same identity that never reached a checkpoint simply restarts."""
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    leftovers = sorted(n for n in names
                       if n in RECORD_FILES or STEP_DIR.match(n) or n.startswith("metrics_step"))
    if leftovers and not save_overwrite:
        same_run = False
        if "config.json" in names:
            with open(os.path.join(out_dir, "config.json")) as f:
                same_run = identity_of(json.load(f)) == identity_of(run_config)
        checkpoints = find_checkpoints(out_dir)
        problem = same_run and first_problem(checkpoints)
        if problem:
            raise CheckpointError(f"{out_dir} holds this run, but none of its checkpoints is "
                                  f"usable ({problem}); resume from the bucket's copy if "
                                  "checkpoint.remote_folder has one, or pass "
                                  "--checkpoint.save_overwrite=true to train it again from step 0.")
        if checkpoints or not same_run:  # (the same run with no checkpoint yet simply restarts)
            shown = ", ".join(leftovers[:3])
            raise CheckpointError(f"{out_dir} already holds another run ({shown}); resume it, "
                                  "choose another train.out_dir, or pass "
                                  "--checkpoint.save_overwrite=true to replace it.")


def first_problem(checkpoints):
    """Why the newest of `checkpoints` [(step, path)] cannot be resumed, when none can; else ""."""
    problems = []
    for _, path in reversed(checkpoints):
        try:
            verify_checkpoint(path)
            return ""
        except CheckpointError as error:
            problems.append(str(error))
    return problems[0] if problems else ""


def check_shared_folder(out_dir, rank, world_size, group=None):
    """Every rank must see the run folder rank 0 writes (checkpoints, CANCEL, the lock): with
    node-local folders, the other nodes would start from step 0 with other weights until a
    collective times out. Rank 0 writes a token there, every rank reads it, and all agree before
    anyone reads a checkpoint (OLMo-core raises too on an unshared folder)."""
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
    dist.all_gather_object(blind, None if seen else f"{rank} on {socket.gethostname()}",
                           group=group)
    blind = [b for b in blind if b is not None]
    dist.barrier(group=group)
    if rank == 0:
        os.remove(path)
    if blind:
        raise CheckpointError(f"rank(s) {', '.join(blind)} do not see the files rank 0 writes in "
                              f"train.out_dir={out_dir}: every node must reach the run folder on "
                              "one shared filesystem (an NFS or Lustre path, not a node-local "
                              "disk); set train.out_dir to one.")


# ------------------------------------------------------------------------------ the bucket's part


def read_bucket(c, out_dir, run_config):
    """checkpoint.remote_folder's complete checkpoint steps, and whether the run there is this one
    (the same identity fields; an empty bucket folder is anyone's). Another run is refused unless
    save_overwrite; the run of out_dir itself, given another identity setting, is refused as a
    resume of out_dir would be, and save_overwrite replaces it there as in out_dir."""
    from lab import remote

    url = c.remote_folder
    saved, steps = remote.read_run(url)
    if saved is None and not steps:
        return steps, True
    difference = ("its config", "unreadable", "")
    if saved is not None:
        difference = identity_difference(saved, run_config)
    own = os.path.join(out_dir, "config.json")
    if difference and saved is not None and os.path.exists(own) and not c.save_overwrite:
        with open(own) as f:
            ours = json.load(f)
        # the bucket holds this folder's run: a setting changed
        if not identity_difference(ours, saved):
            key, old, new = difference
            raise CheckpointError(f"{out_dir} and checkpoint.remote_folder={url} hold a run with "
                                  f"{key}={old!r} and this run has {key}={new!r}, which cannot be "
                                  f"resumed correctly; set {as_override(key, old)} to resume it, "
                                  "or start fresh in another train.out_dir and remote folder (or "
                                  "pass --checkpoint.save_overwrite=true to replace it in both).")
    if difference and not c.save_overwrite:
        key, old, new = difference
        raise CheckpointError(f"checkpoint.remote_folder={url} holds another run ({key}={old!r} "
                              f"there, {new!r} here); give this run another remote folder, or pass "
                              "--checkpoint.save_overwrite=true to replace that run there.")
    return steps, not difference


def bucket_run_config(url):
    """The config of the run whose checkpoints checkpoint.remote_folder holds (fields added since:
    their defaults), or None when it holds no complete checkpoint or no readable config."""
    from lab import remote

    bucket_config, bucket_steps = remote.read_run(url)
    if bucket_steps and bucket_config:
        return with_defaults(bucket_config)
    return None


def fetch_from_bucket(out_dir, url, bucket_steps, rewind_to):
    """checkpoint.remote_folder: the checkpoint to resume from, downloaded into `step<N>.download`,
    or None: the bucket's newest when out_dir has no valid checkpoint as new (a fresh node after a
    preemption), or with a rewind to a step only the bucket has, that step."""
    from lab import remote

    own = newest_valid_checkpoint(out_dir)
    own_step = int(STEP_DIR.match(os.path.basename(own)).group(1)) if own else -1
    if rewind_to:
        wanted = [] if rewind_to in {s for s, _ in find_checkpoints(out_dir)} else [rewind_to]
    else:
        wanted = [s for s in reversed(bucket_steps) if s > own_step]
    return remote.download_newest(url, wanted, out_dir, fall_back=not rewind_to)


def replace_bucket_note(c, bucket_steps):
    """A fresh start, or another run, with checkpoints in the bucket: refused (it would mix two runs
    there) unless save_overwrite, which replaces that run whole. Returns the note to print."""
    if not c.save_overwrite:
        raise CheckpointError(f"checkpoint.remote_folder={c.remote_folder} holds checkpoints "
                              f"({steps_text(bucket_steps)}) and this run starts afresh, which "
                              "would mix two runs there; resume them "
                              "(checkpoint.load=if_available), give another remote folder, or "
                              "pass --checkpoint.save_overwrite=true.")
    return (f"note: replacing the run in {c.remote_folder} (checkpoint.save_overwrite): its "
            "checkpoints go once this run's first is uploaded")


def carry_out_in_bucket(out_dir, start, url):
    """carry_out_start's part in the bucket, before the folder's: a downloaded checkpoint becomes
    the folder's own, and a rewind moves the bucket's newer steps aside (first: a restart must not
    download what goes aside). Returns the line to print, or None."""
    from lab import remote

    line = None
    if start.fetched:
        start.path, line = remote.install_download(out_dir, start.fetched, url)
    if start.rewind_to:
        folder_name = os.path.basename(start.rewind_folder)[: -len(".partial")]
        remote.rewind(url, start.rewind_to, folder_name)
    return line


def steps_text(steps):
    """`steps 4, 6, 8`, or with more than three `5 steps: 2, ..., 6, 8, 10` (a long list would bury
    the sentence)."""
    if len(steps) <= 3:
        return f"steps {', '.join(map(str, steps))}"
    return f"{len(steps)} steps: {steps[0]}, ..., {', '.join(map(str, steps[-3:]))}"


# -------------------------------------------------------------------------------- carrying it out
# Once decided: the checkpoint loaded on every rank, then the folder changed on rank 0.


def load_start(cfg, place, start, raw_model, optimizer, stages, sample_generator, plan, run_config):
    """Load the checkpoint the run starts from (the optimizer keeps this config's settings), carry
    out the rest of the start in the run folder (carry_out_start), and say where the run starts.
    Returns (TrainState, the checkpoint folders of a run this one replaces, deleted after our first
    save)."""
    ck, out_dir = cfg.checkpoint, cfg.train.out_dir
    state = TrainState(best_val_loss=torch.tensor(float("inf"), device=place.device),
                       data=stages.loaders[0][1].state_dict())
    names = [name for loaders in stages.loaders for name, _ in loaders[0]]
    fingerprints = {name: fingerprint(dataset_dir(cfg.data.data_root, name))
                    for name in dict.fromkeys(names)}
    load_optim = start.resumed or ck.load_optim
    saved = None
    if start.path:
        saved = load_checkpoint(start.path, model=raw_model, optimizer=optimizer,
                                sample_generator=sample_generator, rank=place.rank,
                                world_size=place.world_size, load_optim=load_optim,
                                load_trainer_state=start.resumed or ck.load_trainer_state,
                                sharding=place.sharding)
    if saved:
        state = TrainState.from_dict(saved)
        state.best_val_loss = state.best_val_loss.to(place.device)
        # the data position is global: any world size works
        stages.resume_at(state.step, state.data)
        check_start_step(cfg, start, state, plan, fingerprints)
    state.data_fingerprint, state.model_code = fingerprints, model_code(cfg.train.model_module)
    replaced = []
    if place.world_size > 1:
        dist.barrier()  # every rank has read the start before rank 0 moves files into place
    if place.is_master:
        saved_config = saved["config"] if start.resumed else None
        trains = state.step < plan.end_step or not start.resumed
        replaced, lines = carry_out_start(out_dir, start, saved_config, run_config, state.step, ck,
                                          trains)
        if trains:  # a command that trains nothing leaves the record as it is
            save_environment(out_dir, place.world_size)
        mixes = [f"data: {shares_text(stages.loaders[0][0])}"]
        if plan.stage2_step:
            mixes.append(f"stage 2 after step {plan.stage2_step}: "
                         f"{shares_text(stages.loaders[-1][0])}")
        benchmark = ("note: train.no_checkpoints: this run loads no checkpoint and saves none"
                     if cfg.train.no_checkpoints else "")
        mixed = "; ".join(mixes) if cfg.data.mix or cfg.stage2.start else ""
        for line in filter(None, [benchmark, started_from(start, saved, load_optim, state.step),
                                  mixed, *start.notes, *lines]):
            print(line)
    if place.world_size > 1:
        dist.barrier()  # the folder is ready before any rank writes or checks for a CANCEL file
    return state, replaced


def check_start_step(cfg, start, state, plan, fingerprints):
    """Before the run folder changes: a resume must read the data it trained on (the same content,
    whatever data.data_root now says), and a start from another run's trainer state must leave steps
    to train."""
    changed = [name for name, print_ in fingerprints.items()
               if state.data_fingerprint.get(name, print_) != print_]
    if start.resumed and changed:
        raise CheckpointError(f"the dataset {changed[0]} under "
                              f"data.data_root={cfg.data.data_root or '(data/)'} is not the one "
                              "this run trained on (its content differs); point data.data_root at "
                              "the run's data, or train on this data in a new train.out_dir.")
    # (hard_stop=0: save what was loaded, train nothing)
    if not start.resumed and state.step >= plan.end_step > 0:
        raise CheckpointError(f"checkpoint.load_path={start.path} is at step {state.step}, and "
                              f"this run ends at step {plan.end_step}, so nothing would train; "
                              "raise train.max_steps, or pass "
                              "--checkpoint.load_trainer_state=false to train from its weights "
                              "from step 0.")


def started_from(start, saved, load_optim, step):
    """What was loaded: this run's own checkpoint (a resume), what checkpoint.load_path gave, or
    nothing ("")."""
    if start.resumed:
        return f"resumed from {start.path} at step {step}"
    if not start.path:
        return ""
    # else GPT-2's weights, with a fresh optimizer
    ours = os.path.exists(os.path.join(start.path, MARKER))
    loaded = ["weights"]
    if ours and load_optim:
        loaded.append("optimizer state")
    if saved is not None:
        loaded.append("trainer state")
    return f"loaded {', '.join(loaded)} from {start.path}; the run starts at step {step}"


def carry_out_start(out_dir, start, saved_config, run_config, step, checkpoint_cfg, trains=True):
    """Rank 0, once the start is loaded: carry out the Start. Returns the old run's checkpoints, to
    delete once this run's first is complete, and the lines to print. `trains`: False for a resume
    past its end (no change recorded)."""
    c, lines = checkpoint_cfg, []
    if c.remote_folder:
        lines.append(carry_out_in_bucket(out_dir, start, c.remote_folder))
    if start.rewind_to:
        from lab.rewind import rewind
        lines.append(rewind(out_dir, start.rewind_to, start.rewind_folder, c.rewind_number))
    replaced = []
    if start.resumed:
        accept_resume(out_dir, saved_config, run_config, step, trains, start.code_changes)
    else:
        replaced = claim_for_fresh_start(out_dir, run_config, c.save_overwrite)
    remove_own_partial_saves(out_dir)  # what a crash in the middle of a save left behind
    truncate_jsonl(os.path.join(out_dir, "metrics.jsonl"), after_step=step)  # those steps run again
    for path in metrics_snapshots(out_dir, from_step=step + 1).values():  # and their evaluations'
        os.remove(path)
    lines.append(remove_stale_cancel(out_dir))
    return replaced, [line for line in lines if line]


def accept_resume(out_dir, saved_config, run_config, step, trains=True, code=None):
    """Rank 0, resuming: note and record every change of a setting that may change (check_identity
    has refused the others), and of the model code (`code`: {file: (hash saved, hash now)}, noted
    already), unless the run trains nothing (no step runs under them)."""
    changes = changed_fields(saved_config, run_config)
    if changes and trains:
        print(f"note: resuming at step {step} with changed settings: "
              + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    changes |= {f"model code {name}": (old and old[:12], new and new[:12])
                for name, (old, new) in (code or {}).items()}
    if changes and trains:  # one curve in metrics.jsonl may be made by two models: said here
        with open(os.path.join(out_dir, "config_changes.jsonl"), "a") as f:
            changed = {k: list(v) for k, v in changes.items()}
            f.write(json.dumps({"step": step, "changes": changed}) + "\n")
    if not os.path.exists(os.path.join(out_dir, "config.json")):
        write_config(out_dir, saved_config)


def claim_for_fresh_start(out_dir, run_config, save_overwrite):
    """A fresh start (check_fresh_start first): this run's record replaces the old one's now: its
    config, an empty metrics log (the snapshots go with it) and samples file, and no W&B id (a new
    W&B run, never the old one continued). Returns the old run's checkpoint folders, to delete once
    this run's first checkpoint is complete."""
    check_fresh_start(out_dir, run_config, save_overwrite)
    checkpoints = [path for _, path in find_checkpoints(out_dir)]
    write_config(out_dir, run_config)
    for name in os.listdir(out_dir):
        if name in RECORD_FILES and name != "config.json":
            os.remove(os.path.join(out_dir, name))
    for path in metrics_snapshots(out_dir).values():
        os.remove(path)
    return checkpoints


def write_config(out_dir, run_config):
    tmp = os.path.join(out_dir, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(run_config, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "config.json"))


def remove_own_partial_saves(out_dir):
    """Delete the `step<N>.partial` folders an interrupted save of this project left (nothing else).
    """
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


# ------------------------------------------------------------------------------ load_path's shape


def use_load_path_shape(cfg, default_config):
    """Before anything is written: a GPT-2 gives the model its shape, and a path that is neither a
    folder nor a GPT-2 name is one sentence (a typo would train from scratch). A run that already
    has its own checkpoint of the same load_path resumes it: the shape is the checkpoint's, and the
    source is not needed any more (a deleted folder, a hub name offline)."""
    from lab.hf import gpt2_shape, is_gpt2_source, use_source_shape

    ck = cfg.checkpoint
    own = newest_checkpoint(cfg.train.out_dir) if ck.load != "never" else None
    saved = read_trainer_state(own)["config"] if own else None
    # a fresh node: the run's own is in the bucket
    if saved is None and ck.remote_folder and ck.load != "never":
        saved = bucket_run_config(ck.remote_folder)
    if saved:  # a run resumes its own checkpoint, whose shape it has, whatever load_path says now
        use_source_shape(saved["model"], cfg.model, saved["checkpoint"].get("load_path"),
                         "the run's own checkpoint", default_config)
    elif is_gpt2_source(ck.load_path):
        check_source(ck.load_path, "checkpoint.load_path")
        # (hf.load_gpt2_weights copies whole tensors into the model)
        if cfg.train.data_parallel == "fsdp":
            raise ConfigError(f"checkpoint.load_path={ck.load_path} is GPT-2's weights, which load "
                              "into a whole model, and train.data_parallel=fsdp shards it; "
                              "fine-tune with --train.data_parallel=ddp.")
        use_source_shape(gpt2_shape(ck.load_path), cfg.model, ck.load_path, "a GPT-2",
                         default_config)
    elif not os.path.isdir(ck.load_path):
        check_source(ck.load_path, "checkpoint.load_path")


# ------------------------------------------------------------------------------------ stack dumps
# Each rank writes its pid file and dumps its threads' stacks on SIGUSR1 when `python lab/debug.py
# stacks RUN` asks for them.

STACKS = "stacks"  # <out_dir>/stacks/: each rank's pid file and stack dumps

PROC = "/proc"  # where Linux tells each process's start time (see process_start_time)

def process_start_time(pid):
    """When process `pid` started, in clock ticks after boot (field 22 of /proc/<pid>/stat), or None
    when no such process runs. A pid is reused once its process ends; a (pid, start time) pair is
    not."""
    try:
        with open(os.path.join(PROC, str(pid), "stat")) as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2, the command name, is in parentheses and may hold spaces and ")": count from the last
    # ")".
    return int(stat.rsplit(")", 1)[1].split()[19])


def register_stack_dump(out_dir, rank):
    """Write this rank's pid, host and start time, and dump its threads' stacks on SIGUSR1. Returns
    a function that undoes both (the pid file must not outlive the process). A no-op where SIGUSR1
    does not exist (Windows)."""
    if not hasattr(signal, "SIGUSR1"):
        return lambda: None
    folder = os.path.join(out_dir, STACKS)
    os.makedirs(folder, exist_ok=True)
    # the global rank: nodes sharing a folder never collide
    pid_path = os.path.join(folder, f"rank{rank}.pid")
    # The start time proves to `lab/debug.py stacks` that the pid is still this rank's: after a
    # kill -9 the file stays behind, and the pid may go to a process that SIGUSR1 would kill (its
    # default action).
    start_time = process_start_time(os.getpid()) if os.path.isdir(PROC) else None
    with open(pid_path, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "rank": rank,
                   "start_time": start_time}, f)
    # Append mode: `lab/debug.py stacks` empties the file before signalling, and the dump lands at
    # its start.
    stacks_file = open(os.path.join(folder, f"rank{rank}.txt"), "a")
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)

    def undo():
        faulthandler.unregister(signal.SIGUSR1)
        stacks_file.close()
        if os.path.exists(pid_path):
            os.remove(pid_path)

    return undo
