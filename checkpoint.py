"""Checkpoints: exact, crash-safe, optionally asynchronous, and resumable on any number of ranks.

A checkpoint is a folder `<out_dir>/step<N>/` (N = optimizer steps completed):

    model.pt     the model's weights (no DDP or torch.compile prefixes)
    optim.pt     AdamW's state
    trainer.pt   step, tokens seen, data position, every RNG state (per rank), resolved config, ...
    COMPLETE     written last: {"step", "kind", "files": {name: sha256}}

`<out_dir>/latest` is a symlink to the newest complete one. A crash at any instant leaves either the
old state or the new one: files are written under temporary names, fsynced and renamed, the folder is
renamed from `step<N>.partial`, and only then is COMPLETE written. A folder without COMPLETE is never
loaded (and is deleted at the next start); a file whose checksum does not match makes the loader fall
back to the previous complete checkpoint, with a warning. Rank 0 writes (the state is replicated);
every rank reads.

    python checkpoint.py list RUN_DIR               # the complete checkpoints of a run
    python checkpoint.py export-hf CHECKPOINT OUT   # a Hugging Face GPT-2 folder (see hf.py)
"""

import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import threading
import warnings

import numpy as np
import torch
import torch.distributed as dist

from configurator import config_from_dict
from hf import OPENAI_MODELS, WeightsError, export_hf, import_hf, is_hf_folder
from model import GPT

MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step(\d+)$")
# Fields that must match to load weights; dropout may differ (e.g. fine-tuning with dropout).
SHAPE_FIELDS = ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "bias")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message says what to do."""


# ----------------------------------------------------------------------------- finding checkpoints


def is_complete_checkpoint(path):
    return os.path.isfile(os.path.join(path, MARKER))


def find_checkpoints(run_dir):
    """[(step, path), ...] of the complete checkpoints in `run_dir`, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in os.listdir(run_dir):
        match = STEP_DIR.match(name)
        if match and is_complete_checkpoint(os.path.join(run_dir, name)):
            found.append((int(match.group(1)), os.path.join(run_dir, name)))
    return sorted(found)


def read_marker(path):
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def verify_checkpoint(path):
    """Raise CheckpointError unless every file matches the checksum in the marker."""
    try:
        files = read_marker(path)["files"]
    except (OSError, ValueError, KeyError):
        raise CheckpointError(f"{path} has an unreadable {MARKER} marker") from None
    for name, expected in files.items():
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise CheckpointError(f"{file_path} is missing")
        if sha256_file(file_path) != expected:
            raise CheckpointError(f"{file_path} does not match its checksum (truncated or corrupt)")


def newest_valid_checkpoint(run_dir):
    """The newest checkpoint whose files pass their checksums; corrupt ones are skipped with a warning."""
    for _, path in reversed(find_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as error:
            warnings.warn(f"skipping checkpoint: {error}; falling back to the previous one")
    return None


def resolve_checkpoint(source):
    """A checkpoint folder, or a run folder (its newest valid checkpoint)."""
    if is_complete_checkpoint(source):
        try:
            verify_checkpoint(source)
        except CheckpointError as error:
            raise CheckpointError(f"{error}; give the run folder instead to fall back to its newest good "
                                  f"checkpoint.") from None
        return source
    path = newest_valid_checkpoint(source)
    if path is None:
        raise CheckpointError(f"no complete checkpoint at {source}; give a step<N> folder or a run folder "
                              f"that holds one.")
    return path


# ----------------------------------------------------------------------------- writing


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path, data):
    """Write `data` so that `path` holds either nothing or all of it; returns its sha256."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return hashlib.sha256(data).hexdigest()


def write_checkpoint(out_dir, step, snapshot, kind):
    """Write `snapshot` ({"model": ..., "optim": ..., "trainer": ...}) as out_dir/step<N>."""
    final = os.path.join(out_dir, f"step{step}")
    partial = f"{final}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    checksums = {}
    for name, obj in snapshot.items():
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        checksums[f"{name}.pt"] = write_file_atomic(os.path.join(partial, f"{name}.pt"), buffer.getvalue())
    fsync_dir(partial)
    if os.path.exists(final):  # a leftover without marker, or a run being replaced (save_overwrite)
        shutil.rmtree(final)
    os.replace(partial, final)
    fsync_dir(out_dir)
    marker = {"step": step, "kind": kind, "files": checksums}
    write_file_atomic(os.path.join(final, MARKER), json.dumps(marker, indent=1).encode())
    fsync_dir(final)
    # Swap the `latest` symlink atomically: a reader sees the old target or the new one.
    tmp_link = os.path.join(out_dir, "latest.tmp")
    if os.path.lexists(tmp_link):
        os.remove(tmp_link)
    os.symlink(f"step{step}", tmp_link)
    os.replace(tmp_link, os.path.join(out_dir, "latest"))
    fsync_dir(out_dir)
    return final


def remove_incomplete(run_dir):
    """Delete what a crash mid-save left behind: `*.partial` folders and step folders without marker."""
    if not os.path.isdir(run_dir):
        return
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if name.endswith(".partial") or (STEP_DIR.match(name) and not is_complete_checkpoint(path)):
            shutil.rmtree(path, ignore_errors=True)


def prune_checkpoints(run_dir, keep_last):
    """Retention (as OLMo-core): an ephemeral checkpoint lives until a newer one exists; only the
    `keep_last` newest permanent ones are kept (0 keeps all); `fixed` ones are always kept; the
    newest complete checkpoint is never deleted."""
    found = find_checkpoints(run_dir)
    if not found:
        return
    newest = found[-1][1]
    permanent = [path for _, path in found if read_marker(path).get("kind") == "permanent"]
    doomed = [path for _, path in found if read_marker(path).get("kind") == "ephemeral"]
    if keep_last > 0:
        doomed += permanent[:-keep_last]
    for path in doomed:
        if path != newest:
            shutil.rmtree(path, ignore_errors=True)


def checkpoint_kind(step, cfg, final):
    """Which kind of checkpoint is due after `step`, or None. `final` means the run is ending."""
    c = cfg.checkpoint
    if step in c.fixed_steps:
        return "fixed"
    if final or (c.interval and step % c.interval == 0):
        return "permanent"
    if c.ephemeral_interval and step % c.ephemeral_interval == 0:
        return "ephemeral"
    return None


class Checkpointer:
    """Saves on rank 0, synchronously or on a background thread (at most one save in flight)."""

    def __init__(self, out_dir, keep_last, async_save, is_master):
        self.out_dir, self.keep_last = out_dir, keep_last
        self.async_save, self.is_master = async_save, is_master
        self.thread, self.error = None, None

    def save(self, step, snapshot, kind):
        self.wait()  # the previous save must finish before the next one starts
        if not self.is_master:
            return
        if self.async_save:
            self.thread = threading.Thread(target=self._write, args=(step, snapshot, kind), daemon=True)
            self.thread.start()
        else:
            self._write(step, snapshot, kind)
            self.wait()

    def _write(self, step, snapshot, kind):
        try:
            write_checkpoint(self.out_dir, step, snapshot, kind)
            prune_checkpoints(self.out_dir, self.keep_last)
        except BaseException as error:  # re-raised in the training thread by wait()
            self.error = error

    def wait(self):
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"saving a checkpoint in {self.out_dir} failed: {error}") from error


# ----------------------------------------------------------------------------- what to load


def choose_checkpoint(out_dir, load, load_path):
    """(path, resuming): the checkpoint this run starts from, and whether it is this run's own.
    `load`: if_available resumes from out_dir when it holds a checkpoint, always requires one, never
    starts fresh. load_path is used only when out_dir has none (e.g. to fine-tune another run)."""
    if load == "never":
        return None, False
    own = newest_valid_checkpoint(out_dir)
    if own:
        return own, True
    if load_path:
        return resolve_checkpoint(load_path), False
    if load == "always":
        raise CheckpointError(f"checkpoint.load=always but {out_dir} holds no complete checkpoint and "
                              f"checkpoint.load_path is empty; set checkpoint.load_path or use load=if_available.")
    return None, False


RUN_FILES = ("config.json", "metrics.jsonl", "samples.txt", "latest")


def claim_run_dir(out_dir, run_config, save_overwrite):
    """Before a fresh start: refuse to overwrite a different run in out_dir unless save_overwrite.
    A run with the same model, data and optimizer that never reached a checkpoint simply restarts."""
    saved_config_path = os.path.join(out_dir, "config.json")
    leftovers = [n for n in RUN_FILES if os.path.lexists(os.path.join(out_dir, n))]
    leftovers += [n for n in sorted(os.listdir(out_dir)) if STEP_DIR.match(n)] if os.path.isdir(out_dir) else []
    if not leftovers:
        return
    same_run = False
    if os.path.exists(saved_config_path) and not any(STEP_DIR.match(n) for n in leftovers):
        with open(saved_config_path) as f:
            same_run = run_identity(json.load(f)) == run_identity(run_config)
    if not same_run and not save_overwrite:
        raise CheckpointError(f"{out_dir} already holds another run ({', '.join(leftovers[:3])}); resume it, choose "
                              f"another train.out_dir, or pass --checkpoint.save_overwrite=true to replace it.")
    for name in leftovers:  # the user asked to replace the run (or it is the same run, restarting)
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def run_identity(config_dict):
    """What makes two runs the same run: model, data, optimizer, seed and batch."""
    train = config_dict.get("train", {})
    return (config_dict.get("model"), config_dict.get("data", {}).get("dataset"), config_dict.get("optim"),
            train.get("seed"), train.get("total_batch_size"))


# ----------------------------------------------------------------------------- training state


def to_cpu(obj):
    """A copy of every tensor on the CPU: training may change the originals while a thread writes."""
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
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "sample": sample_generator.get_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state, sample_generator):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    sample_generator.set_state(state["sample"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def capture_state(raw_model, optimizer, trainer_state, sample_generator, is_master):
    """Everything needed to resume, copied to the CPU on rank 0. Every rank must call it: the RNG
    states of all ranks are gathered (ranks draw different dropout masks)."""
    rng = rng_state(sample_generator)
    if dist.is_initialized():
        all_rng = [None] * dist.get_world_size()
        dist.all_gather_object(all_rng, rng)
    else:
        all_rng = [rng]
    if not is_master:
        return None
    return to_cpu({"model": raw_model.state_dict(), "optim": optimizer.state_dict(),
                   "trainer": {**trainer_state, "rng": all_rng}})


def check_model_shape(saved_model_config, model_config, path):
    for name in SHAPE_FIELDS:
        saved, wanted = saved_model_config.get(name), getattr(model_config, name)
        if saved != wanted:
            raise CheckpointError(f"checkpoint {path} has model.{name}={saved} but this run has "
                                  f"model.{name}={wanted}; set --model.{name}={saved} or load another checkpoint.")


def load_checkpoint(path, raw_model, optimizer, sample_generator, rank, load_optim=True, load_trainer_state=True):
    """Restore weights (and optimizer, RNG) from `path`; returns the saved trainer state, or None."""
    device = next(raw_model.parameters()).device
    trainer = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)
    check_model_shape(trainer["config"]["model"], raw_model.config, path)
    raw_model.load_state_dict(torch.load(os.path.join(path, "model.pt"), map_location=device, weights_only=True))
    if load_optim:
        optimizer.load_state_dict(torch.load(os.path.join(path, "optim.pt"), map_location=device, weights_only=True))
    if not load_trainer_state:
        return None
    rng = trainer["rng"]
    set_rng_state(rng[rank] if rank < len(rng) else rng[0], sample_generator)
    return trainer


def load_model(source, device):
    """A GPT from any `--init_from` SOURCE: a run folder (its newest valid checkpoint), a checkpoint
    folder, an OpenAI GPT-2 name (gpt2 ... gpt2-xl, via transformers) or a local HF GPT-2 folder."""
    if source in OPENAI_MODELS or is_hf_folder(source):
        return import_hf(source).to(device).eval()
    if not os.path.isdir(source):
        raise CheckpointError(f"--init_from={source} is not a folder nor one of {', '.join(OPENAI_MODELS)}; give a "
                              f"run folder, a step<N> checkpoint folder, a GPT-2 name or a HF GPT-2 folder.")
    path = resolve_checkpoint(source)
    trainer = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)
    model = GPT(config_from_dict(trainer["config"]).model)
    model.load_state_dict(torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=True))
    return model.to(device).eval()


def main(argv):
    if len(argv) >= 2 and argv[0] == "list":
        for step, path in find_checkpoints(argv[1]):
            print(f"step {step:>8}  {read_marker(path).get('kind', '?'):<9}  {path}")
    elif len(argv) == 3 and argv[0] == "export-hf":
        export_hf(resolve_checkpoint(argv[1]), argv[2])
    else:
        sys.exit("usage: python checkpoint.py list RUN_DIR | export-hf CHECKPOINT OUT_DIR")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (CheckpointError, WeightsError) as error:
        sys.exit(f"error: {error}")
