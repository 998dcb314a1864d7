"""What makes a folder a checkpoint, wherever it lies: in the run folder (checkpoint.py writes and
reads it) or in a bucket (lab/remote.py uploads and downloads it).

A checkpoint is a folder `step<N>/` whose COMPLETE marker, written last, is a readable JSON object
{"step", "kind", "files": {name: sha256}}: a folder without one (a save cut short, a damaged
marker) is never used, and a file that fails its checksum is never loaded. Retention (`doomed`)
decides which checkpoints go, by the same rule in the folder and in the bucket. This file imports
nothing of the project, so the bucket's code and the checkpointer share it without importing each
other.
"""

import hashlib
import json
import os
import re
import sys

MARKER = "COMPLETE"
STEP_DIR = re.compile(r"^step(\d+)$")
WARNED = set()  # unreadable markers already reported (one warning each)


def read_marker(path, fs=None):
    """The COMPLETE marker of checkpoint folder `path` (in a bucket with `fs`, an fsspec
    filesystem), or None if it is missing or unreadable (not a dict of files): such a folder is
    never used."""
    try:
        if fs is None:
            with open(os.path.join(path, MARKER), "rb") as f:
                marker = json.loads(f.read())
        else:
            marker = json.loads(fs.cat_file(f"{path}/{MARKER}"))
        if isinstance(marker, dict) and isinstance(marker.get("files"), dict):
            return marker
        return None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def is_complete_checkpoint(path):
    """A folder with a readable marker; an unreadable one means "not a checkpoint" everywhere, with
    one warning."""
    if read_marker(path) is not None:
        return True
    if os.path.exists(os.path.join(path, MARKER)) and path not in WARNED:
        WARNED.add(path)
        print(f"warning: {path} has an unreadable {MARKER} marker; it is not used as a checkpoint",
              file=sys.stderr, flush=True)
    return False


def find_checkpoints(run_dir):
    """[(step, path), ...] of the complete checkpoints in `run_dir`, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    named = [(STEP_DIR.match(name), os.path.join(run_dir, name)) for name in os.listdir(run_dir)]
    return sorted((int(match.group(1)), path) for match, path in named
                  if match and is_complete_checkpoint(path))


def newest_checkpoint(run_dir):
    """The newest complete checkpoint of `run_dir` (unverified), or None."""
    found = find_checkpoints(run_dir)
    return found[-1][1] if found else None


def first_link(path):
    """The first file or folder inside checkpoint folder `path` that is a link (its path), or None.
    A checkpoint is read only from its own files: a link may point anywhere, to a file that passes
    the checksum today and changes tomorrow. `path` itself may be a link (the run's `latest`)."""
    for folder, folders, files in os.walk(path):  # (never into a linked folder: it is named here)
        for name in sorted(folders + files):
            if os.path.islink(os.path.join(folder, name)):
                return os.path.join(folder, name)
    return None


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def doomed(kinds, keep_last):
    """Retention (as OLMo-core), in the folder and in the bucket alike: {step: kind} -> the steps to
    delete. An ephemeral checkpoint lives until a newer one exists; the `keep_last` newest permanent
    ones are kept (0: all), fixed ones always; never the newest."""
    steps = sorted(kinds)
    permanent = [s for s in steps if kinds[s] == "permanent"]
    gone = [s for s in steps if kinds[s] == "ephemeral"]
    if keep_last > 0:
        gone += permanent[:-keep_last]
    return sorted(s for s in gone if s != steps[-1])
