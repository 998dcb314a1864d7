"""Checkpoints in object storage (`checkpoint.remote_folder`): a copy in a bucket that outlives the node.

A GPU job on a cloud or preemptible node loses its local disk when the node goes. With
`--checkpoint.remote_folder=s3://bucket/run1` (or `gs://...`, or `file:///...`), every checkpoint is still
written to `train.out_dir` first, exactly as without it, and then a background thread uploads it:

    s3://bucket/run1/step<N>/model.pt, optim.pt, trainer.pt   the files, uploaded first
    s3://bucket/run1/step<N>/COMPLETE                         uploaded last: object stores have no rename,
                                                               so a step without it is never used
    s3://bucket/run1/config.json, metrics.jsonl                copies, to inspect a run from the bucket
    s3://bucket/run1/rewound/<when>_to_step<S>/step<N>         what a rewind moved aside (nothing is deleted)

On start, when `out_dir` holds no valid checkpoint as new as the bucket's newest complete one, that one
is downloaded (each file checked against the checksums in its COMPLETE marker) and the run resumes from
it, bit for bit. Retention (`checkpoint.keep_last`, ephemeral and fixed checkpoints) applies to the bucket
by the same rule as to the folder. An upload that fails is retried, then reported on the console and in
the metrics (`checkpoint/upload_failures`); the run goes on with its local checkpoints.

fsspec (installed with `datasets`) speaks every store; the store's own package is optional, like
`transformers`: `pip install s3fs` for s3://, `pip install gcsfs` for gs://. Credentials and the endpoint
come from the store's standard environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL;
GOOGLE_APPLICATION_CREDENTIALS), as every tool of that store reads them.
"""

import hashlib
import json
import os
import queue
import shutil
import sys
import threading
import time
import uuid

from config import UserError

MARKER = "COMPLETE"  # checkpoint.py's marker (checkpoint.py imports this module, so the name is repeated here)
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}  # schemes whose package is optional
# Short timeouts and few attempts per request, so an endpoint that went away fails an upload in seconds
# (it is retried as a whole) instead of holding the upload thread for minutes.
S3_OPTIONS = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}}
RETRIES = (1.0, 4.0)  # seconds between the attempts of an upload: three attempts in all


class RemoteError(UserError):
    """A remote folder that cannot be used; the message says what to do."""


def is_url(path):
    return isinstance(path, str) and "://" in path


def filesystem(url, key="checkpoint.remote_folder"):
    """(fsspec filesystem, path inside it) of `url`; one sentence if its scheme's package is missing."""
    import fsspec

    scheme = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url, **(S3_OPTIONS if PACKAGES.get(scheme) == "s3fs" else {}))
    except ImportError:
        package = PACKAGES.get(scheme, scheme)
        raise RemoteError(f"{key}={url} needs the {package} package, which is not installed; "
                          f"pip install {package}.") from None
    except ValueError as error:
        raise RemoteError(f"{key}={url}: {error}; give an s3://, gs:// or file:// URL.") from None
    return fs, path.rstrip("/")


def describe_failure(error):
    """What went wrong with a store, in words a user can act on."""
    text = f"{type(error).__name__}: {error}"
    if "NoCredentials" in text or "Unable to locate credentials" in text:
        return "no credentials were found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the store's own)"
    if any(word in text for word in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden",
                                     "PermissionError", "403")):
        return f"the credentials were refused ({text[:200]})"
    if "NoSuchBucket" in text or isinstance(error, FileNotFoundError):
        return "the bucket does not exist (create it first)"
    if any(word in text for word in ("connect", "Connect", "resolve", "Name or service", "timed out", "Timeout")):
        return f"the endpoint cannot be reached ({text[:200]})"
    return text[:300]


def check(url, key="checkpoint.remote_folder"):
    """Before anything is written: one sentence unless the run can write in `url` (package, credentials,
    bucket, endpoint). A probe object is written and deleted, since only a write proves write access."""
    fs, root = filesystem(url, key)
    if url.startswith("file://"):
        os.makedirs(root, exist_ok=True)
    probe = f"{root}/.write_check_{uuid.uuid4().hex}"
    try:
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except Exception as error:  # each store raises its own kinds
        raise RemoteError(f"{key}={url} cannot be written: {describe_failure(error)}; fix that, or leave "
                          f"{key} empty to keep checkpoints in train.out_dir only.") from None


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ----------------------------------------------------------------------------- reading the bucket


def complete_checkpoints(fs, root):
    """{step: marker} of the checkpoints in the bucket whose COMPLETE marker is there and readable."""
    fs.invalidate_cache()  # listings are cached per filesystem; the bucket may have changed since
    found = {}
    try:
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return found
    for name in names:
        if name.startswith("step") and name[4:].isdigit():
            try:
                found[int(name[4:])] = json.loads(fs.cat_file(f"{root}/{name}/{MARKER}"))
            except (FileNotFoundError, ValueError):
                pass  # no marker (an upload cut short) or an unreadable one: not a checkpoint
    return found


def newest_complete(url):
    """The bucket's newest complete checkpoint step, or None."""
    fs, root = filesystem(url)
    found = complete_checkpoints(fs, root)
    return max(found) if found else None


def download(url, step, folder):
    """Download checkpoint `step` of `url` into `folder` (created; a `.partial` name first, so a kill never
    leaves a folder that looks whole) and check every file against its marker's checksum. Returns `folder`."""
    fs, root = filesystem(url)
    marker = json.loads(fs.cat_file(f"{root}/step{step}/{MARKER}"))
    partial = f"{folder}.partial"
    for leftover in (partial, folder):  # what a download cut short left behind
        shutil.rmtree(leftover, ignore_errors=True)
    os.makedirs(partial)
    for name, expected in marker["files"].items():
        fs.get_file(f"{root}/step{step}/{name}", os.path.join(partial, name))
        if sha256_file(os.path.join(partial, name)) != expected:
            shutil.rmtree(partial, ignore_errors=True)
            raise RemoteError(f"{url}/step{step}/{name} does not match its checksum (a corrupt upload); delete "
                              f"that step from the bucket to fall back to the one before.")
    with open(os.path.join(partial, MARKER), "w") as f:
        json.dump(marker, f, indent=1)  # the marker last, as checkpoint.py writes it
    os.replace(partial, folder)
    return folder


def fetch_file(url, name, path):
    """The bucket's copy of the run file `name` (config.json, metrics.jsonl) into `path`; False if it has none."""
    fs, root = filesystem(url)
    try:
        fs.get_file(f"{root}/{name}", path)
    except FileNotFoundError:
        return False
    return True


def local_copy(url, key):
    """A local folder holding the checkpoint `url` names (a run folder: its newest complete checkpoint; or
    .../step<N>), downloaded once into a cache (NANOGPT_REMOTE_CACHE, default ~/.cache/nanogpt-lab/remote)."""
    fs, root = filesystem(url, key)
    base, last = root.rsplit("/", 1) if "/" in root else ("", root)
    if last.startswith("step") and last[4:].isdigit():
        run_url, step = url.rstrip("/").rsplit("/", 1)[0], int(last[4:])
    else:
        run_url, step = url, newest_complete(url)
        if step is None:
            raise RemoteError(f"{key}={url} holds no complete checkpoint; give a run folder or step<N> folder in the "
                              f"bucket that holds one.")
    cache = os.environ.get("NANOGPT_REMOTE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nanogpt-lab",
                                                                 "remote"))
    folder = os.path.join(cache, hashlib.sha256(run_url.rstrip("/").encode()).hexdigest()[:16], f"step{step}")
    if not os.path.exists(os.path.join(folder, MARKER)):
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        download(run_url, step, folder)
    return folder


# ----------------------------------------------------------------------------- writing the bucket


def doomed_steps(kinds, keep_last):
    """Retention, the rule checkpoint.prune_checkpoints applies to the folder: {step: kind} -> steps to
    delete. Ephemeral ones go once a newer one exists, permanent ones beyond the `keep_last` newest (0 keeps
    all), fixed ones never; the newest is never deleted."""
    steps = sorted(kinds)
    permanent = [s for s in steps if kinds[s] == "permanent"]
    doomed = [s for s in steps if kinds[s] == "ephemeral"]
    if keep_last > 0:
        doomed += permanent[:-keep_last]
    return sorted(s for s in doomed if s != steps[-1])


class Uploader:
    """Rank 0's background uploads to `url`, one at a time in order, each retried. `upload_checkpoint`
    only queues (the loop never waits for the store); `failures` counts uploads that failed every attempt."""

    def __init__(self, url, keep_last):
        self.url, self.keep_last = url, keep_last
        self.fs, self.root = filesystem(url)
        self.jobs = queue.Queue()
        self.failures = 0
        self.thread = threading.Thread(target=self._work, name="checkpoint-upload", daemon=True)
        self.thread.start()

    def upload_checkpoint(self, folder, also=()):
        """Queue checkpoint `folder` (files, then COMPLETE), then the files `also` (config.json, metrics.jsonl)
        beside the checkpoints, then retention in the bucket."""
        self.jobs.put((f"checkpoint {os.path.basename(folder)}", lambda: self._checkpoint(folder, also)))

    def _checkpoint(self, folder, also):
        remote = f"{self.root}/{os.path.basename(folder)}"
        if self.fs.exists(f"{remote}/{MARKER}"):
            self.fs.rm_file(f"{remote}/{MARKER}")  # a step being replaced is incomplete until all is new
        names = sorted(os.listdir(folder))
        for name in [n for n in names if n != MARKER] + [MARKER]:
            self.fs.put_file(os.path.join(folder, name), f"{remote}/{name}")
        for path in also:
            if os.path.exists(path):
                self.fs.put_file(path, f"{self.root}/{os.path.basename(path)}")
        found = complete_checkpoints(self.fs, self.root)
        for step in doomed_steps({s: marker.get("kind") for s, marker in found.items()}, self.keep_last):
            self.fs.rm(f"{self.root}/step{step}", recursive=True)

    def _work(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            what, work = job
            for attempt, pause in enumerate((*RETRIES, None)):
                try:
                    work()
                    break
                except Exception as error:  # each store raises its own kinds; the run must go on
                    if pause is None:
                        self.failures += 1
                        print(f"warning: uploading {what} to {self.url} failed {attempt + 1} times "
                              f"({describe_failure(error)}); training goes on, and the checkpoint is in "
                              f"train.out_dir.", file=sys.stderr, flush=True)
                    else:
                        time.sleep(pause)
            self.jobs.task_done()

    def close(self, timeout=600.0):
        """Wait (at most `timeout` seconds) for the queued uploads, then stop the thread."""
        self.jobs.put(None)
        self.thread.join(timeout)
        if self.thread.is_alive():
            print(f"warning: uploads to {self.url} still running after {timeout:.0f} s at exit; the bucket may lack "
                  f"the newest checkpoint (train.out_dir has it).", file=sys.stderr, flush=True)


def rewind(url, step, folder_name):
    """A rewind in the bucket: its checkpoints after `step` move to rewound/<folder_name>/ (copied, then removed
    with their COMPLETE first, so a kill midway leaves no complete checkpoint past `step`). Nothing is deleted
    that is not copied first. Synchronous, at start-up: a restart must not download what the rewind put aside."""
    fs, root = filesystem(url)
    for newer in sorted(s for s in complete_checkpoints(fs, root) if s > step):
        source, target = f"{root}/step{newer}", f"{root}/rewound/{folder_name}/step{newer}"
        fs.copy(source, target, recursive=True)
        fs.rm_file(f"{source}/{MARKER}")
        fs.rm(source, recursive=True)
