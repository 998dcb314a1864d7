"""Checkpoints: exact, crash-safe, optionally asynchronous, and resumable on any number of ranks.

A checkpoint is a folder `<out_dir>/step<N>/` (N = optimizer steps completed):

    model.pt     every weight by name (no DDP or torch.compile prefixes); a tied one stored once
    optim.pt     the optimizer's state (AdamW's; with optim.name=muon, Muon's and AdamW's)
    trainer.pt   step, tokens seen, data position, every rank's RNG states, the config, ...
    COMPLETE     written last: {"step", "kind", "files": {name: sha256}}
    sharded/     an FSDP run's, instead of model.pt and optim.pt: each rank's pieces of both,
                 written by torch.distributed.checkpoint (`__<rank>_0.distcp`, `.metadata`),
                 nothing gathered on one rank; every reader puts them together (lab/fsdp.py)

Every file is written into `step<N>.partial` and fsynced; one rename makes `step<N>` appear whole,
so a crash at any instant leaves the old state or the new one. `<out_dir>/latest` links the newest.
A folder without a readable marker is never loaded; a file that fails its checksum makes the loader
fall back to the previous checkpoint, with a warning. Rank 0 writes (the state is replicated; under
FSDP every rank writes its pieces first); every rank reads. Locks, fresh starts and resumes in the
run folder are run_dir.py's.

    python checkpoint.py list RUN_DIR               # the complete checkpoints of a run
    python checkpoint.py export-hf CHECKPOINT OUT   # a Hugging Face GPT-2 folder (lab/hf.py)
"""

import argparse
import ast
import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import random
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from checkpoint_folder import (MARKER, doomed, find_checkpoints, first_link,
                               is_complete_checkpoint, read_marker, sha256_file)
from config import UserError, config_from_dict, keys_with_role, run_command, with_defaults
from devices import DEVICES
from metrics import metrics_snapshots, warn_slow
from model import GPT

SHARDED = "sharded"  # an FSDP run's folder of pieces inside a checkpoint (fsdp.FOLDER)
# What must match to load weights: the model's `identity` fields (config.py); dropout may differ
# (fine-tuning).
SHAPE_FIELDS = [key.split(".")[1] for key in keys_with_role("identity", "model")]


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message says what to do."""


class UntrustedCheckpoint(CheckpointError):
    """Files that pass their checksums and still cannot be used: never skipped for an older
    checkpoint in silence."""


def refuse_links(path):
    """UntrustedCheckpoint when a file or folder in checkpoint folder `path` is a link: checked by
    every reader, before the checksums and before each file is read."""
    link = first_link(path)
    if link:
        raise UntrustedCheckpoint(f"{link} is a link (to {os.readlink(link)}), and a checkpoint is "
                                  "read only from its own files, so it is not loaded: put the file "
                                  "itself in its place (`cp -rL` copies a folder with its links as "
                                  "files), or give another checkpoint.")


def verify_checkpoint(path):
    """Raise CheckpointError, before any file is loaded, unless no file is a link, every file
    matches its checksum, and sharded/'s .metadata passes check_sharded_metadata."""
    refuse_links(path)
    marker = read_marker(path)
    if marker is None:
        raise CheckpointError(f"{path} has a missing or unreadable {MARKER} marker")
    files = marker["files"]
    for name, expected in files.items():
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise CheckpointError(f"{file_path} is missing")
        if sha256_file(file_path) != expected:
            raise CheckpointError(f"{file_path} does not match its checksum (truncated or corrupt)")
    check_sharded_metadata(path, files)


def check_sharded_metadata(path, files):
    """An FSDP run's sharded/.metadata through fsdp.check_metadata, whose refusal is an
    UntrustedCheckpoint."""
    if os.path.isdir(os.path.join(path, SHARDED)):
        from lab import fsdp
        try:
            fsdp.check_metadata(path, files, MARKER)
        except fsdp.MetadataRefused as refused:
            raise UntrustedCheckpoint(str(refused)) from None


def newest_valid_checkpoint(run_dir):
    """The newest checkpoint whose files pass their checksums; corrupt ones are skipped with a
    warning."""
    for _, path in reversed(find_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except UntrustedCheckpoint:
            raise
        except CheckpointError as error:
            print(f"warning: skipping checkpoint: {error}; falling back to the previous one",
                  file=sys.stderr, flush=True)
    return None


def resolve_checkpoint(source):
    """A checkpoint folder, or a run folder (its newest valid checkpoint)."""
    if is_complete_checkpoint(source):
        try:
            verify_checkpoint(source)
        except UntrustedCheckpoint:
            raise
        except CheckpointError as error:
            raise CheckpointError(f"{error}; give the run folder instead to fall back to its "
                                  "newest good checkpoint.") from None
        return source
    path = newest_valid_checkpoint(source)
    if path is None:
        raise CheckpointError(f"no complete checkpoint at {source}; give a step<N> folder or a run "
                              "folder that holds one.")
    return path


def fsync_dir(path):
    """Make a folder's entries durable: a file's own fsync does not cover its name in the folder
    (a creation, a rename, a removal)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path, data):
    """Write `data` so that `path` holds either nothing or all of it, on disk; returns its
    sha256."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def write_checkpoint(out_dir, step, snapshot, kind, sharded=False):
    """Write `snapshot` ({"model", "optim", "trainer"}) as out_dir/step<N>, and point `latest` at
    it; returns the folder. Every file goes into step<N>.partial and is fsynced, COMPLETE last
    ({"step", "kind", "files": {name: sha256}}); one rename makes step<N> appear whole (one already
    there is replaced only then), so a crash at any instant leaves the old state or the new one.
    `sharded`: FSDP's ranks have written step<N>.partial/sharded/ already (lab/fsdp.py)."""
    final = os.path.join(out_dir, f"step{step}")
    partial, old = f"{final}.partial", f"{final}.replaced"
    checksums = {}
    if sharded:
        pieces = os.path.join(partial, SHARDED)
        checksums = {f"{SHARDED}/{name}": sha256_file(os.path.join(pieces, name))
                     for name in sorted(os.listdir(pieces))}
        fsync_dir(pieces)
    else:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    for name, obj in snapshot.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        checksums[f"{name}.pt"] = write_file_atomic(os.path.join(partial, f"{name}.pt"),
                                                    buffer.getvalue())
    marker = {"step": step, "kind": kind, "files": checksums}
    write_file_atomic(os.path.join(partial, MARKER), json.dumps(marker, indent=1).encode())
    fsync_dir(partial)
    if os.path.exists(final):  # the same step saved again: the new one replaces it whole
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    shutil.rmtree(old, ignore_errors=True)
    link_latest(out_dir, f"step{step}")
    return final


def link_latest(out_dir, name):
    """Point out_dir/latest at `name`, swapped atomically: a reader sees the old target or the new
    one."""
    link = os.path.join(out_dir, "latest.tmp")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(name, link)
    os.replace(link, os.path.join(out_dir, "latest"))
    fsync_dir(out_dir)


class Checkpointer:
    """Saves the run's checkpoints in `out_dir`: every rank captures its part (the RNG states of all
    ranks are gathered; under FSDP each rank writes its own pieces), rank 0 writes the rest,
    synchronously or on a background thread (checkpoint.async_save: at most one save in flight),
    then applies retention (`doomed`) to the checkpoints it knows, read from the folder once at
    start. `replaced`: the checkpoints of a run this one replaces (checkpoint.save_overwrite),
    deleted once this run's first is complete. `uploader` (lab/remote.py): each complete checkpoint
    is queued for upload, and retention keeps it until its upload ends. `sharding`: lab/fsdp.py's
    ShardedCheckpoints under train.data_parallel=fsdp, else None."""

    def __init__(self, out_dir, checkpoint_cfg, config_dict, is_master, replaced=(), uploader=None,
                 sharding=None, soft_timeout=30.0):
        c = checkpoint_cfg
        self.out_dir, self.keep_last, self.async_save = out_dir, c.keep_last, c.async_save
        self.unsharded_interval, self.is_master = c.unsharded_interval, is_master
        self.config_dict = config_dict
        self.replaced, self.uploader = list(replaced), uploader
        self.sharding = sharding  # lab/fsdp.py's ShardedCheckpoints, or None: is the model sharded?
        self.soft_timeout = soft_timeout  # log.bookkeeping_soft_timeout: a longer wait warns
        self.kinds = {}  # {step: kind} of the checkpoints in out_dir, which retention deletes
        if is_master:
            self.kinds = {step: read_marker(path).get("kind")
                          for step, path in find_checkpoints(out_dir) if path not in self.replaced}
        self.thread, self.error = None, None
        self.pruning = threading.Lock()  # retention runs on the save thread and the upload thread
        if uploader:
            uploader.on_done = self.prune

    def upload_metrics(self):
        """checkpoint/upload_failures (uploads that failed every attempt) and
        checkpoint/upload_lag_sec (how long the oldest checkpoint waiting for its upload has
        waited); other ranks say 0."""
        uploader = self.uploader
        return {"checkpoint/upload_failures": uploader.failures if uploader else 0,
                "checkpoint/upload_lag_sec": uploader.lag() if uploader else 0.0}

    def save(self, step, kind, model, optimizer, state, sample_generator):
        """Save the state after `step`: the raw `model`'s weights, the optimizer's state, the
        trainer's `state` (a TrainState: counters, data position) with the config, and every rank's
        RNG states. Every rank calls it. Prints how long the loop stalled (rank 0)."""
        start = time.perf_counter()
        self.wait_for_previous()
        captured = self.capture(step, model, optimizer, state, sample_generator)
        if captured is None:  # a rank other than 0, with no pieces to write
            return time.perf_counter() - start
        snapshot, shards = captured
        if self.async_save:
            self.thread = threading.Thread(target=self.write, args=(step, snapshot, kind, shards),
                                           daemon=True)
            self.thread.start()
        else:
            self.write(step, snapshot, kind, shards)
            if self.error is not None:
                self.wait()  # (raises it)
        stalled = time.perf_counter() - start
        if self.is_master and step > 0:
            how = "async" if self.async_save else "sync"
            print(f"checkpoint step{step} ({kind}, {how}): the loop stalled {stalled:.3f} s",
                  flush=True)
        return stalled

    def wait_for_previous(self):
        """The previous save lands before this one starts: at most one snapshot in CPU memory. A
        wait longer than log.bookkeeping_soft_timeout warns."""
        if self.thread is None and self.error is None:
            return
        start = time.perf_counter()
        self.wait()
        if time.perf_counter() - start > self.soft_timeout:
            warn_slow("waiting for the previous checkpoint", time.perf_counter() - start,
                      self.soft_timeout)

    def capture(self, step, model, optimizer, state, sample_generator):
        """This rank's part of a save: (snapshot {"model", "optim", "trainer"} for rank 0 to write,
        FSDP's pieces being written or None), or None on a rank that writes nothing. Every rank's
        RNG states are gathered; under FSDP every rank starts writing its pieces."""
        sharding = self.sharding
        whole, shards = None, None
        if sharding and self.unsharded_interval and step % self.unsharded_interval == 0:
            whole = sharding.whole_weights(model, tied=set(ties(model)))  # every rank sends pieces
        trainer = state.to_dict()
        rng = [rng_state(sample_generator)]
        if dist.is_initialized():
            rng = [None] * dist.get_world_size()
            dist.all_gather_object(rng, rng_state(sample_generator))
        if sharding:  # every rank writes its pieces of the weights and the optimizer's state
            try:
                shards = sharding.start(self.out_dir, step, model, optimizer, self.is_master,
                                        self.async_save, tied=set(ties(model)))
            except sharding.errors as error:
                raise self.failed(step, error) from None
        elif not self.is_master:
            return None
        if sharding:  # the pieces are being written: a whole model.pt at most
            snapshot = {"model": whole} if whole else {}
        else:
            snapshot = {"model": model_weights(model), "optim": optimizer.state_dict()}
        snapshot["trainer"] = {**trainer, "config": self.config_dict, "rng": rng}
        # A copy on the CPU, which training cannot change while a thread writes it; a sync save on a
        # CPU writes the tensors themselves, as nothing runs meanwhile.
        if self.async_save or next(model.parameters()).device.type != "cpu":
            snapshot = to_cpu(snapshot)
        return snapshot, shards

    def write(self, step, snapshot, kind, shards=None):
        """Rank 0's part of a save (on the save thread with async_save): once FSDP's ranks have
        written their `shards`, write_checkpoint; then the checkpoints of the run this one replaces
        go, the upload is queued and retention runs. An error is kept, and wait() raises it in the
        training thread."""
        try:
            if shards is not None:
                shards.wait()  # every rank's pieces, and .metadata, are on disk
                if not self.is_master:
                    return
            final = write_checkpoint(self.out_dir, step, snapshot, kind, shards is not None)
            for path in self.replaced:
                if os.path.abspath(path) != os.path.abspath(final):
                    shutil.rmtree(path, ignore_errors=True)
            self.replaced = []
            if self.uploader:
                self.uploader.upload_checkpoint(final, step, kind)
            self.kinds[step] = kind
            self.prune()
        except BaseException as error:  # re-raised in the training thread by wait()
            self.error = (step, error)

    def prune(self):
        """Retention on the checkpoints this run knows, but never one still waiting for its upload.
        """
        with self.pruning:
            waiting = self.uploader.waiting() if self.uploader else ()
            for step in doomed(self.kinds, self.keep_last):
                path = os.path.join(self.out_dir, f"step{step}")
                if path not in waiting:  # its marker first: a kill midway leaves no checkpoint
                    if os.path.exists(os.path.join(path, MARKER)):
                        os.remove(os.path.join(path, MARKER))
                    shutil.rmtree(path, ignore_errors=True)
                    del self.kinds[step]

    def wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            (step, error), self.error = self.error, None  # a Ctrl-C in a sync save stays one
            raise error if isinstance(error, KeyboardInterrupt) else self.failed(step, error)

    def failed(self, step, error):
        """The one sentence that ends a run whose save of `step` failed, once rank 0 has removed
        what it left: the partial folder (the disk's space) and the metrics snapshots of this step
        and later (async_save fails at the next save), which name checkpoints that never were."""
        # FSDP's pieces: DCP raises its error, which gathers every rank's failures, on every rank
        every_rank = self.sharding is not None and hasattr(error, "failures")
        reason = getattr(error, "strerror", None) or str(error).strip()[:200]
        where = "no checkpoint of this run is intact yet"
        if self.is_master:
            shutil.rmtree(os.path.join(self.out_dir, f"step{step}.partial"), ignore_errors=True)
            for path in metrics_snapshots(self.out_dir, from_step=step).values():
                os.remove(path)
            found = find_checkpoints(self.out_dir)  # what is on disk now, whatever this run knew
            if found:  # (the step itself, when what failed came after its folder was complete)
                where = f"step{found[-1][0]} is intact"
                if found[-1][0] == step:
                    where += " all the same"
        if every_rank:  # rank 0 has cleaned up before any rank exits, and it alone speaks
            reason = self.sharding.why_not_saved(error)
            dist.barrier(group=self.sharding.group)
        error = CheckpointError(f"saving the checkpoint of step {step} in {self.out_dir} failed "
                                f"({reason}); {where}: free disk space, then run the same command "
                                "again to resume.")
        error.every_rank = every_rank
        return error


@dataclass
class TrainState:
    """The loop's counters and data position, saved like any other component (as torchtitan does)
    beside weights, optimizer and RNG states: `to_dict` is what trainer.pt holds, `from_dict` what a
    resume restores."""
    step: int = 0  # optimizer steps completed
    tokens: int = 0  # training tokens consumed
    # lowest val/loss so far (a device tensor in the loop: no sync to update)
    best_val_loss: object = math.inf
    data: dict = field(default_factory=dict)  # the position of the loader in use (its state_dict)
    # steps train.nan_policy=skip passed over for a non-finite loss or gradient
    nonfinite_skipped: int = 0
    # {name: data.fingerprint}: a resume on other data is refused
    data_fingerprint: dict = field(default_factory=dict)
    # {file: hash} (model_code): a resume with other code is told so
    model_code: dict = field(default_factory=dict)

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, saved):
        saved = {"model_code": {}, **saved}  # (none in checkpoints from before it)
        return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls)})


def read_trainer_state(path):
    """trainer.pt of a checkpoint folder, on the CPU; a config field added since it was saved takes
    its default."""
    trainer = read_file(path, "trainer.pt")
    trainer["config"] = with_defaults(trainer["config"])
    return trainer


def holds_weights(obj):
    return isinstance(obj, dict) and all(isinstance(k, str) and torch.is_tensor(v)
                                         for k, v in obj.items())


def holds_optimizer_state(obj):  # an optimizer's state_dict, or MuonAdamW's {name: state_dict}
    return isinstance(obj, dict) and (("state" in obj and "param_groups" in obj) or (
        bool(obj) and all(map(holds_optimizer_state, obj.values()))))


def holds_trainer_state(obj):
    return (isinstance(obj, dict) and isinstance(obj.get("config"), dict)
            and isinstance(obj.get("step"), int) and isinstance(obj.get("rng"), list))


# What each file holds, in words and as a check: one that passes its checksum may still hold a list
# or a number.
FILE_CONTENTS = {"model.pt": ("weights by name", holds_weights),
                 "optim.pt": ("an optimizer's state", holds_optimizer_state),
                 "trainer.pt": ("the trainer's state", holds_trainer_state)}


def read_file(path, name, device="cpu", mmap=False):
    """torch.load(weights_only=True) of checkpoint file `name` in `path`: one sentence when it is
    not what this trainer writes there (an object weights_only refuses to build, or another kind of
    value). A reader that did not verify the folder first (the start reads the config of the newest
    checkpoint) still meets refuse_links."""
    refuse_links(path)
    file_path = os.path.join(path, name)
    what, holds = FILE_CONTENTS[name]
    try:
        obj = torch.load(file_path, map_location=device, weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError, OSError) as error:
        first_line = (str(error).splitlines() or [""])[0][:150]
        raise UntrustedCheckpoint(f"{file_path} cannot be read as {what} ({type(error).__name__}: "
                                  f"{first_line}); give a checkpoint this trainer saved.") from None
    if not holds(obj):
        raise UntrustedCheckpoint(f"{file_path} holds a {type(obj).__name__}, not {what}; give a "
                                  "checkpoint this trainer saved.")
    return obj


def to_cpu(obj):
    """A copy of every tensor on the CPU: training may change the originals as a thread writes."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def rng_state(sample_generator):
    """This rank's RNG states, in types that torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(),
             "sample": sample_generator.get_state()}
    devices = [k for k in DEVICES.values() if k.rng_state]  # (devices.py's table) with a generator
    return {**state, **{k.name: s for k in devices if (s := k.rng_state()) is not None}}


def set_rng_state(state, sample_generator):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    sample_generator.set_state(state["sample"])
    for kind in (k for k in DEVICES.values() if k.name in state and k.available()):
        kind.set_rng_state(state[kind.name])


def check_model_shape(saved_model_config, model_config, path):
    """Weights load only into the same shape: `model_config` (a dict, as the config saves it)
    against the saved."""
    for name in SHAPE_FIELDS:
        saved, wanted = saved_model_config.get(name), model_config[name]
        if saved != wanted:
            raise CheckpointError(f"checkpoint {path} has model.{name}={saved} but this run has "
                                  f"model.{name}={wanted}; set --model.{name}={saved} or load "
                                  "another checkpoint.")


def ties(model):
    """{second name: first name} of each tensor the model holds under two names (the output layer
    tied to the token embedding: lm_head.weight -> transformer.wte.weight): one Parameter object,
    not two tensors that are equal."""
    first, tied = {}, {}
    named = [*model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        tied_to = first.setdefault(id(tensor), name)
        if tied_to != name:
            tied[name] = tied_to
    return tied


def model_weights(model):
    """The model's state_dict with each tensor once: the second name of a tied tensor (one Parameter
    under two names, `ties`) is left out, and saved_weights puts it back. Every other weight is
    saved by its name, whatever the model is."""
    weights, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            weights[name] = tensor.detach()
    return weights


def only_pieces(path):
    """An FSDP run's checkpoint without a whole model.pt: its weights are in sharded/ alone."""
    return os.path.isdir(os.path.join(path, SHARDED)) and not os.path.exists(
        os.path.join(path, "model.pt"))


def saved_shapes(path):
    """{name: (shape, dtype)} of the weights in checkpoint `path`, without reading them: model.pt is
    memory-mapped (only its index is read); a sharded checkpoint's are in its .metadata."""
    if only_pieces(path):
        from lab import fsdp
        return fsdp.tensor_shapes(os.path.join(path, SHARDED))
    saved = read_file(path, "model.pt", mmap=True)
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in saved.items()}


def saved_weights(path, model, device):
    """{name: tensor} of the weights in checkpoint `path`, a tied weight (stored once) under each
    name `model` ties it to: model.pt (an FSDP run's too, with checkpoint.unsharded_interval), or an
    FSDP run's pieces put together."""
    if only_pieces(path):
        from lab import fsdp
        pieces = fsdp.read_tensors(os.path.join(path, SHARDED))
        state = {name: t.to(device) for name, t in pieces.items()}
    else:
        state = read_file(path, "model.pt", device)
    for name, first in ties(model).items():
        state.setdefault(name, state[first])
    return state


def check_weights_fit(path, model, advice):
    """One sentence, before anything is loaded, when a name, shape or dtype differs between `path`'s
    weights and `model`'s."""
    saved = saved_shapes(path)
    wanted = {name: (tuple(t.shape), t.dtype) for name, t in model_weights(model).items()}
    tied = ties(model)  # a checkpoint may hold a tied weight under both names: the same weight
    problems = [f"{name} is not in it" for name in wanted if name not in saved]
    problems += [f"it has {name}, which this model has not" for name in saved
                 if name not in wanted and name not in tied]
    problems += [f"{name} is {list(saved[name][0])} there and {list(shape)} here"
                 for name, (shape, _) in wanted.items()
                 if name in saved and tuple(saved[name][0]) != shape]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"the weights in {path} do not fit this model: "
                              f"{'; '.join(problems[:3])}{more}. The model code changed since that "
                              f"checkpoint was saved: {advice}")
    cast = [name for name, (_, dtype) in wanted.items() if saved[name][1] != dtype]
    if cast:  # (this trainer saves each weight as its model holds it)
        raise UntrustedCheckpoint(f"{path} holds {cast[0]} as {saved[cast[0]][1]} and this model "
                                  f"as {wanted[cast[0]][1]}, which a load would cast in silence; "
                                  "give a checkpoint this trainer saved.")


def group_layout(state):
    """[(group name, number of parameters)] of an optimizer's state_dict (MuonAdamW's holds one per
    optimizer)."""
    if "param_groups" in state:
        return [(group.get("name"), len(group["params"])) for group in state["param_groups"]]
    return [layout for inner in state.values() for layout in group_layout(inner)]


def check_group_layout(saved, optimizer, path):
    """One sentence when the saved optimizer state (if any) belongs to other parameter groups than
    `optimizer`'s."""
    if saved is not None and group_layout(saved) != group_layout(optimizer.state_dict()):
        raise CheckpointError(f"checkpoint {path} holds optimizer state for other parameter groups "
                              f"({group_layout(saved)}, this run has "
                              f"{group_layout(optimizer.state_dict())}: optim.name or "
                              "optim.decay_embeddings differ, or the model code now gives a "
                              "parameter another kind); set them as the checkpoint's run did, or "
                              "--checkpoint.load_optim=false to start the optimizer afresh.")


def keep_settings(optimizer, load):
    """Run `load`, which brings back the saved groups' LR peak, weight decay, betas, eps and
    momentum with the moments, then put this run's settings back: the config in force is what the
    optimizer uses."""
    in_force = [{key: value for key, value in group.items() if key != "params"}
                for group in optimizer.param_groups]
    load()
    for group, settings in zip(optimizer.param_groups, in_force):
        group.update(settings)


def load_checkpoint(path, *, model, optimizer, sample_generator, rank, world_size, load_optim=True,
                    load_trainer_state=True, sharding=None):
    """Restore weights (and optimizer, RNG) from `path` into the raw `model`; returns the saved
    trainer state, or None. RNG states go back only to the rank that saved them: after a change of
    world size, ranks without one keep their fresh seeded state (dropout masks then differ from an
    uninterrupted run, as they must: there is none). `sharding` (not None): the model is sharded
    (lab/fsdp.py), and loads through load_with_shards whatever the checkpoint."""
    device = next(model.parameters()).device
    # not a checkpoint of ours: GPT-2's weights (lab/hf.py)
    if not os.path.exists(os.path.join(path, MARKER)):
        from lab.hf import load_gpt2_weights
        load_gpt2_weights(model, path)
        return None
    trainer = read_trainer_state(path)
    check_model_shape(trainer["config"]["model"], dataclasses.asdict(model.config), path)
    saved_optimizer = trainer["config"]["optim"].get("name", "adamw")
    # MuonAdamW.name is "muon"
    if load_optim and saved_optimizer != getattr(optimizer, "name", "adamw"):
        raise CheckpointError(f"checkpoint {path} holds the state of optim.name={saved_optimizer} "
                              "and this run uses another optimizer; set "
                              "--checkpoint.load_optim=false to start the optimizer afresh.")
    check_weights_fit(path, model, "load it into the model it was trained with.")
    if os.path.isdir(os.path.join(path, SHARDED)) or sharding is not None:
        load_with_shards(path, model, optimizer if load_optim else None, device)
    else:
        model.load_state_dict(saved_weights(path, model, device))
        if load_optim:  # the moments, with this run's settings kept
            saved = read_file(path, "optim.pt", device)
            check_group_layout(saved, optimizer, path)
            keep_settings(optimizer, lambda: optimizer.load_state_dict(saved))
    if not load_trainer_state:
        return None
    rng = trainer["rng"]
    if rank < len(rng):
        set_rng_state(rng[rank], sample_generator)
    if len(rng) != world_size and rank == 0:
        print(f"note: {path} was saved by {len(rng)} rank(s) and this run has {world_size}; the "
              "data position carries over exactly, but only ranks "
              f"0..{min(len(rng), world_size) - 1} get their saved RNG state.")
    return trainer


def load_with_shards(path, model, optimizer, device):
    """Where FSDP is on either side, once check_weights_fit has passed: a sharded checkpoint into
    any model (each rank reads the pieces it holds; DCP reshards to any world size), or a DDP run's
    model.pt and optim.pt into a sharded model (whole tensors, each rank keeping its pieces).
    `optimizer=None`: the optimizer starts afresh."""
    from lab import fsdp

    if os.path.isdir(os.path.join(path, SHARDED)):
        model_state, optim_state = fsdp.load_shards(path, model, optimizer, tied=ties(model))
        check_group_layout(optim_state, optimizer, path)
        full = False
    else:
        model_state = saved_weights(path, model, device)
        optim_state = read_file(path, "optim.pt", device) if optimizer is not None else None
        check_group_layout(optim_state, optimizer, path)
        model_state, optim_state = fsdp.full_into_sharded(model, optimizer, model_state,
                                                          optim_state)
        full = True
    if optim_state is None:
        fsdp.apply(model, None, model_state, None, full)
    else:
        keep_settings(optimizer,
                      lambda: fsdp.apply(model, optimizer, model_state, optim_state, full))


def check_source(source, key):
    """The checkpoint of `source` (a run or checkpoint folder), or None for GPT-2's weights (an
    OpenAI name, with transformers installed, or a local HF folder); else one sentence naming `key`,
    the setting or flag it came from. Reads no weights, except a bucket's (an s3:// or gs:// URL),
    downloaded once into a cache."""
    from lab.hf import OPENAI_MODELS, is_hf_folder
    # a bucket (lab/remote.py): the local copy is checked as any checkpoint folder is
    if "://" in source:
        from lab import remote
        return resolve_checkpoint(remote.local_copy(source, key))
    if source in OPENAI_MODELS:
        import importlib.util
        if importlib.util.find_spec("transformers") is None:
            raise CheckpointError(f"{key}={source} is loaded with the transformers package, which "
                                  "is not installed; pip install transformers, or give a run "
                                  "folder.")
        return None
    if is_hf_folder(source):
        return None
    if not os.path.isdir(source):
        raise CheckpointError(f"{key}={source} is not a folder nor one of "
                              f"{', '.join(OPENAI_MODELS)}; give a run folder, a step<N> "
                              "checkpoint folder, a GPT-2 name or a HF GPT-2 folder.")
    try:
        return resolve_checkpoint(source)
    except CheckpointError as error:
        hf_files = ("model.safetensors", "pytorch_model.bin")
        if any(os.path.exists(os.path.join(source, name)) for name in hf_files):
            raise CheckpointError(f"{key}={source} holds Hugging Face weights but no readable "
                                  "config.json with a model_type; save the model again with "
                                  "save_pretrained.") from None
        if os.path.exists(os.path.join(source, "config.json")) and not find_checkpoints(source):
            raise CheckpointError(f"{key}={source} holds a config.json but no weights (no "
                                  "checkpoint of this trainer, no model.safetensors or "
                                  "pytorch_model.bin); give a folder that holds weights.") \
                from None
        raise CheckpointError(f"{key}: {error}") from None


def check_named_module(saved, named, what, flag):
    """One sentence when a checkpoint (`what`) was trained with a GPT file of its own (`saved`) and
    the user named none (`named`, by `flag`): a file a checkpoint names is never imported."""
    if saved != "model" and named == "model":
        raise CheckpointError(f"{what} was trained with train.model_module={saved}, and a file a "
                              f"checkpoint names is never imported; pass {flag}={saved} to load it "
                              "with that file, once you trust it.")


# The files that make the model, whose hashes each checkpoint keeps (TrainState.model_code): a
# resume or a tool is told of an edit.
PROJECT = os.path.dirname(os.path.realpath(__file__))
MODEL_FILE = os.path.join(PROJECT, "model.py")


def model_code(model_module):
    """{file: code_hash} of the files that make the model: model.py (GPTConfig, and the GPT unless
    train.model_module names a file of your own), that file, and the project's modules either
    imports, anywhere in it and at any depth (a helper that holds the MLP). An edit to what the
    model computes is a change even with the same weights (QK-norm, a logit cap)."""
    files = {"model.py": MODEL_FILE}
    if model_module != "model":
        files[os.path.realpath(model_module)] = model_module
    waiting = list(files.values())
    while waiting:
        for path in local_imports(waiting.pop()):
            inside = os.path.commonpath([path, PROJECT]) == PROJECT
            name = os.path.relpath(path, PROJECT) if inside else path
            if name not in files:
                files[name] = path
                waiting.append(path)
    return {name: code_hash(path) for name, path in files.items()}


def local_imports(path):
    """The files of the modules `path` imports anywhere (at its top, under `try:`, inside a
    function) that lie in its own folder or the project's (not torch's, not the standard
    library's): real paths."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    found = []
    for name in names:
        for folder in (os.path.dirname(os.path.realpath(path)), PROJECT):
            base = os.path.join(folder, *name.split("."))
            candidates = (f"{base}.py", os.path.join(base, "__init__.py"))
            found += [os.path.realpath(c) for c in candidates if os.path.isfile(c)]
    return list(dict.fromkeys(found))


def code_hash(path):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    # docstrings go, as comments and layout did (ast.parse): none changes what it does
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()


def code_changes(saved_code, model_module):
    """{file: (hash saved, hash now)} of each file of the model's code that is not the same as when
    the checkpoint was saved (None: not a file of it then, or now); {} when no hash was kept."""
    if not saved_code:
        return {}
    now = model_code(model_module)
    return {name: (saved_code.get(name), now.get(name)) for name in {**saved_code, **now}
            if saved_code.get(name) != now.get(name)}


def code_change_note(saved_code, model_module, path, goes_on="the run goes on"):
    """The line to print when the model's source is not the one checkpoint `path` was saved with,
    though its weights fit (the code as it is now may compute another function of them); "" if the
    same, or no hash was kept."""
    changed = code_changes(saved_code, model_module)
    if not changed:
        return ""
    return (f"note: the model code changed since {path} was saved ({', '.join(changed)}); its "
            f"weights fit, so {goes_on} with the code as it is now")


def gpt_class(module="model"):
    """The GPT class that train.model_module names: model.py's, or the one in a .py file of your
    own, which takes the same GPTConfig and answers what the trainer asks (lab/model_module.py
    loads it), so the trainer names no layer of it."""
    if module == "model":
        return GPT
    from lab.model_module import load_gpt_class
    return load_gpt_class(module)


def load_model(source, device, key, model_module="model", flag="--model_module", changed_ok=True):
    """A GPT in eval mode from a source check_source takes, built by model.py or by `model_module`,
    the file the user named (`flag`): a file a checkpoint names is never imported, and a checkpoint
    trained with one the user did not name is refused. Model code changed since the checkpoint is a
    note, or a refusal unless `changed_ok`. Errors name `key` (sample.py's --init_from, ...)."""
    path = check_source(source, key)
    if path is None:
        from lab.hf import import_hf
        return import_hf(source, gpt_class(model_module)).to(device).eval()
    trainer = read_trainer_state(path)
    cfg = config_from_dict(trainer["config"])
    check_named_module(cfg.train.model_module, model_module, f"{key}={source}", flag)
    try:
        model = gpt_class(model_module)(cfg.model)
    except ValueError as error:  # a file that is gone, or lies inside a checkpoint
        raise CheckpointError(f"{flag}: {error}") from None
    check_weights_fit(path, model, "load it into the model it was trained with.")
    model.load_state_dict(saved_weights(path, model, "cpu"))
    changed = code_changes(trainer.get("model_code"), model_module)
    if changed and not changed_ok:  # (the code now would serve another model than was trained)
        raise CheckpointError(f"{path} was saved with other model code than is here now "
                              f"({', '.join(changed)}); check out the code it was trained with, or "
                              "pass --accept_changed_code to use the code as it is now.")
    note = code_change_note(trainer.get("model_code"), model_module, path, goes_on="it is loaded")
    if note and not (dist.is_initialized() and dist.get_rank() != 0):  # (stdout is the tool's)
        print(note, file=sys.stderr)
    return model.to(device).eval()


def main(argv):
    parser = argparse.ArgumentParser(
        description="List a run's checkpoints, or export one as a Hugging Face GPT-2.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the complete checkpoints of a run").add_argument("run_dir")
    export = commands.add_parser("export-hf", help="a Hugging Face GPT-2 folder (lab/hf.py)")
    export.add_argument("checkpoint",
                        help="a step<N> folder or a run folder (its newest valid checkpoint)")
    export.add_argument("out_dir")
    export.add_argument("--model_module", default="model",
                        help="the .py file of the GPT a checkpoint was trained with (its path)")
    export.add_argument("--accept_changed_code", action="store_true", help="use today's model code")
    args = parser.parse_args(argv)
    if args.command == "list":
        if not os.path.isdir(args.run_dir):
            raise CheckpointError(f"{args.run_dir} is not a folder; give the train.out_dir of a "
                                  f"run.")
        # A step<N> folder lists itself; each is verified as the loader verifies it (every
        # file's checksum).
        found = find_checkpoints(args.run_dir)
        if is_complete_checkpoint(args.run_dir):
            found = [(read_marker(args.run_dir)["step"], args.run_dir)]
        if not found:
            raise CheckpointError(f"{args.run_dir} holds no complete checkpoint; give the "
                                  "train.out_dir of a run that saved one, or one of its step<N> "
                                  "folders.")
        for step, path in found:
            try:
                verify_checkpoint(path)
                state = "complete"
            except CheckpointError as error:
                state = f"damaged: {error}"
            print(f"step {step:>8}  {read_marker(path).get('kind', '?'):<9}  {path}  {state}")
    else:
        from lab.hf import check_export_target, export_hf
        check_export_target(args.out_dir)  # before the (slow) load
        export_hf(load_model(args.checkpoint, "cpu", "export-hf's CHECKPOINT", args.model_module,
                             changed_ok=args.accept_changed_code), args.out_dir)


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
