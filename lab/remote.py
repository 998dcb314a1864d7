"""Checkpoints in object storage (`checkpoint.remote_folder`): a copy in a bucket that outlives the
node.

A GPU job on a cloud or preemptible node loses its local disk when the node goes. With
`--checkpoint.remote_folder=s3://bucket/run1` (or `gs://...`, or `file:///...`), every checkpoint is
still written to `train.out_dir` first, exactly as without it, and then a background thread uploads
it:

    s3://bucket/run1/step<N>/model.pt, optim.pt, trainer.pt   the files, uploaded first
    s3://bucket/run1/step<N>/COMPLETE                         uploaded last: object stores have
                                                              no rename, so a step without it is
                                                              never used
    s3://bucket/run1/config.json, metrics.jsonl               copies, to inspect a run from the
                                                              bucket
    s3://bucket/run1/rewound/<when>_to_step<S>/step<N>        what a rewind moved aside (nothing
                                                              is deleted)

On start, when `out_dir` holds no valid checkpoint as new as the bucket's newest complete one, that
one is downloaded (each file checked against the checksums in its COMPLETE marker) and the run
resumes from it, bit for bit. Retention (`checkpoint.keep_last`, ephemeral and fixed checkpoints)
applies to the bucket by the same rule as to the folder. An upload that fails is retried, then
reported on the console and in the metrics (`checkpoint/upload_failures`); the run goes on with its
local checkpoints.

fsspec (installed with `datasets`) speaks every store; the store's own package is optional, like
`transformers`: `pip install s3fs` for s3://, `pip install gcsfs` for gs://. Credentials and the
endpoint come from the store's standard environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL; GOOGLE_APPLICATION_CREDENTIALS), as every tool of that store reads them.
"""

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import uuid

from checkpoint_folder import MARKER, doomed, read_marker, sha256_file
from config import UserError

# schemes whose package is optional
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
# Short timeouts and few attempts per request, so an endpoint that went away fails an upload in
# seconds (it is retried as a whole) instead of holding the upload thread for minutes.
S3_OPTIONS = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                                "retries": {"max_attempts": 2}}}
# The files a checkpoint is made of (checkpoint.py, and DCP's names in an FSDP run's sharded/): a
# download fetches these and no other name its marker lists.
CHECKPOINT_FILE = re.compile(r"(model|optim|trainer)\.pt|sharded/(\.metadata|__\d+_\d+\.distcp)")
RETRIES = (1.0, 4.0)  # seconds between the attempts of an upload: three attempts in all


class RemoteError(UserError):
    """A remote folder that cannot be used; the message says what to do."""


def is_url(path):
    return isinstance(path, str) and "://" in path


def filesystem(url, key="checkpoint.remote_folder"):
    """(fsspec filesystem, path inside it) of `url`; one sentence if it is no URL or its scheme's
    package is missing."""
    import fsspec

    if not is_url(url):
        raise RemoteError(f"{key}={url} is not a URL; give one such as s3://bucket/run1, "
                          "gs://bucket/run1 or file:///shared/run1.")
    scheme = url.split("://", 1)[0]
    # the stores the docs name (ftp:// would try to log in here)
    if scheme not in (*PACKAGES, "file"):
        raise RemoteError(f"{key}={url}: checkpoints are kept in s3://, gs:// or file:// folders, "
                          f"not {scheme}://; give a URL of one of those.")
    try:
        fs, path = fsspec.core.url_to_fs(url,
                                         **(S3_OPTIONS if PACKAGES.get(scheme) == "s3fs" else {}))
    except ImportError:
        package = PACKAGES.get(scheme, scheme)
        raise RemoteError(f"{key}={url} needs the {package} package, which is not installed; "
                          f"pip install {package}.") from None
    except ValueError as error:
        raise RemoteError(f"{key}={url}: {error}; give an s3://, gs:// or file:// URL.") from None
    except OSError as error:  # a store the filesystem's constructor already calls
        raise RemoteError(f"{key}={url} could not be reached ({describe_failure(error)}); check "
                          f"the URL and the network.") from None
    return fs, path.rstrip("/")


def describe_failure(error):
    """What went wrong with a store, in words a user can act on."""
    text = f"{type(error).__name__}: {error}"
    local = getattr(error, "filename", None)
    if isinstance(error, FileNotFoundError) and isinstance(local, str) and os.path.isabs(local):
        return f"the local file {local} is gone (deleted before its upload ended)"
    if "NoCredentials" in text or "Unable to locate credentials" in text:
        return ("no credentials were found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "the store's own)")
    # (403 as a number of its own: the probe's random name, in the text, may hold those digits)
    refused = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden",
               "PermissionError")
    if any(word in text for word in refused) or re.search(r"(?<![0-9a-f])403(?![0-9a-f])", text):
        return f"the credentials were refused ({text[:200]})"
    if ("NoSuchBucket" in text or "bucket does not exist" in text.lower()
            or isinstance(error, FileNotFoundError)):
        return "the bucket does not exist (create it first)"
    if any(word in text for word in ("connect", "Connect", "resolve", "Name or service",
                                     "timed out", "Timeout")):
        return f"the endpoint cannot be reached ({text[:200]})"
    return text[:300]


def check(url, out_dir=None, key="checkpoint.remote_folder"):
    """Before anything is written: one sentence unless the run can write in `url` (package,
    credentials, bucket, endpoint). A probe object is written and deleted, since only a write proves
    write access. A local folder (file://) that is `out_dir`, lies inside it or holds it is refused:
    uploads would replace the run folder's own files, markers included."""
    fs, root = filesystem(url, key)
    if url.startswith("file://") and out_dir:
        folder, run = os.path.realpath(root), os.path.realpath(out_dir)
        if os.path.commonpath([folder, run]) in (folder, run):
            raise RemoteError(f"{key}={url} is train.out_dir={out_dir} or shares its folder tree, "
                              "and the uploads would overwrite the run folder's own files; give a "
                              f"remote folder outside {run}.")
    probe = f"{root}/.write_check_{uuid.uuid4().hex}"
    try:
        if url.startswith("file://"):
            fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except Exception as error:  # each store raises its own kinds
        raise RemoteError(f"{key}={url} cannot be written: {describe_failure(error)}; fix that, or "
                          f"leave {key} empty to keep checkpoints in train.out_dir only.") from None


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


# ----------------------------------------------------------------------------- reading the bucket


def step_folders(fs, root):
    """The step numbers of the bucket's step<N> folders, complete or not ([] when the folder does
    not exist)."""
    fs.invalidate_cache()  # listings are cached per filesystem; the bucket may have changed since
    try:
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(int(name[4:]) for name in names if name.startswith("step") and name[4:].isdigit())


WARNED = set()  # damaged markers in a bucket already reported (one warning each)


def complete_checkpoints(fs, root):
    """{step: marker} of the checkpoints in the bucket whose COMPLETE marker is there and readable.
    A marker that is there and damaged (not a dict of files) is not a checkpoint either, with one
    warning, as checkpoint.py treats a local one: a resume or a reader that falls back to an older
    step says so."""
    found = {}
    for step in step_folders(fs, root):
        path = f"{root}/step{step}/{MARKER}"
        marker = read_marker(f"{root}/step{step}", fs)
        # else an upload cut short (no marker), or a damaged marker: not a checkpoint
        if marker is not None:
            found[step] = marker
        elif path not in WARNED and fs.exists(path):
            WARNED.add(path)
            print(f"warning: {fs.unstrip_protocol(path)} is no readable {MARKER} marker, so "
                  f"step{step} is not used as a checkpoint; delete that step from the bucket, or "
                  "upload it again.", file=sys.stderr, flush=True)
    return found


def newest_complete(url):
    """The bucket's newest complete checkpoint step, or None."""
    fs, root = filesystem(url)
    found = complete_checkpoints(fs, root)
    return max(found) if found else None


def read_run(url):
    """(the config of the run in the bucket, or None; its complete checkpoint steps). The config is
    the bucket's config.json, or when that is missing the one saved in its newest checkpoint's
    trainer.pt."""
    import io

    import torch

    fs, root = filesystem(url)
    try:
        steps = sorted(complete_checkpoints(fs, root))
    except Exception as error:  # each store raises its own kinds
        raise RemoteError(f"checkpoint.remote_folder={url} cannot be read: "
                          f"{describe_failure(error)}; fix that, or leave it empty to resume from "
                          "train.out_dir alone.") from None
    try:
        config = json.loads(fs.cat_file(f"{root}/config.json"))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict) and steps:
        try:
            trainer = torch.load(io.BytesIO(fs.cat_file(f"{root}/step{steps[-1]}/trainer.pt")),
                                 map_location="cpu",
                                 weights_only=True)
            config = trainer["config"]
        except Exception:  # noqa: BLE001 - a damaged trainer.pt: the run's identity is unknown
            config = None
    return (config if isinstance(config, dict) else None), steps


def download(url, step, folder, key="checkpoint.remote_folder"):
    """Download checkpoint `step` of `url` into `folder` (a `.partial` name first, so a kill never
    leaves a folder that looks whole) and check every file against its marker's checksum. Returns
    `folder`. A damaged checkpoint (a marker that is no list of files, a file missing or not
    matching) is one sentence, and nothing is left."""
    fs, root = filesystem(url, key)
    where = f"{url.rstrip('/')}/step{step}"
    partial = f"{folder}.partial"
    for leftover in (partial, folder):  # what a download cut short left behind
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        marker = read_marker(f"{root}/step{step}", fs)
        if marker is None:
            raise RemoteError(f"{where} has a missing or damaged {MARKER} marker, so it is not a "
                              "checkpoint; give another step, or delete that step from the bucket.")
        for name in marker["files"]:  # all checked before anything is written
            if not CHECKPOINT_FILE.fullmatch(name):
                raise RemoteError(f"{where}'s marker lists {name}, which is not a file a "
                                  "checkpoint is made of (model.pt, optim.pt, trainer.pt, sharded/ "
                                  "pieces); delete that step from the bucket to fall back to the "
                                  "one before.")
        os.makedirs(partial)
        for name, expected in marker["files"].items():
            # (sharded/ of an FSDP run)
            os.makedirs(os.path.dirname(os.path.join(partial, name)), exist_ok=True)
            try:
                fs.get_file(f"{root}/step{step}/{name}", os.path.join(partial, name))
            except FileNotFoundError:
                raise RemoteError(f"{where}/{name} is listed in its marker but missing (a damaged "
                                  "upload); delete that step from the bucket to fall back to the "
                                  "one before.") from None
            if sha256_file(os.path.join(partial, name)) != expected:
                raise RemoteError(f"{where}/{name} does not match its checksum (a corrupt upload); "
                                  "delete that step from the bucket to fall back to the one "
                                  "before.")
        with open(os.path.join(partial, MARKER), "w") as f:
            json.dump(marker, f, indent=1)  # the marker last, as checkpoint.py writes it
        os.replace(partial, folder)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return folder


def download_newest(url, steps, out_dir, fall_back):
    """The first of `steps` that downloads whole into out_dir/step<N>.download (or None); with
    `fall_back`, a damaged one is passed over with a warning for the next (a resume), else it is one
    sentence (a rewind to that step)."""
    for step in steps:
        try:
            return download(url, step, os.path.join(out_dir, f"step{step}.download"))
        except RemoteError as error:
            if not fall_back or step == steps[-1]:
                raise
            print(f"warning: {error} Falling back to the checkpoint before it.", file=sys.stderr,
                  flush=True)
    return None


def install_download(out_dir, download_folder, url):
    """A checkpoint downloaded from the bucket becomes the folder's own (its name says its step); so
    do the bucket's copies of the run's config.json and metrics.jsonl where the folder has none (a
    fresh node). Returns (the checkpoint's folder, the line to print)."""
    import re

    final = os.path.join(out_dir,
                         re.fullmatch(r"(step\d+)\.download",
                                      os.path.basename(download_folder)).group(1))
    os.replace(download_folder, final)
    link = os.path.join(out_dir, "latest")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(os.path.basename(final), link)
    for name in ("config.json", "metrics.jsonl"):
        if not os.path.exists(os.path.join(out_dir, name)):
            fetch_file(url, name, os.path.join(out_dir, name))
    return final, f"downloaded {os.path.basename(final)} from {url} into {out_dir}"


def fetch_file(url, name, path):
    """The bucket's copy of the run file `name` (config.json, metrics.jsonl) into `path`; False if
    it has none."""
    fs, root = filesystem(url)
    try:
        fs.get_file(f"{root}/{name}", path)
    except FileNotFoundError:
        return False
    return True


def local_copy(url, key):
    """A local folder holding the checkpoint `url` names (a run folder: its newest complete
    checkpoint; or .../step<N>), downloaded once into a cache (NANOGPT_REMOTE_CACHE, default
    ~/.cache/nanogpt-lab/remote)."""
    fs, root = filesystem(url, key)
    base, last = root.rsplit("/", 1) if "/" in root else ("", root)
    try:
        exists = fs.exists(root)
    except Exception as error:  # each store raises its own kinds
        raise RemoteError(f"{key}={url} cannot be read: {describe_failure(error)}; fix that, or "
                          "give a local folder.") from None
    if not exists:
        raise RemoteError(f"{key}={url} does not exist; give a run folder or step<N> folder in the "
                          "bucket.")
    if last.startswith("step") and last[4:].isdigit():
        run_url, step = url.rstrip("/").rsplit("/", 1)[0], int(last[4:])
    else:
        run_url, step = url, newest_complete(url)
        if step is None:
            raise RemoteError(f"{key}={url} holds no complete checkpoint; give a run folder or "
                              "step<N> folder in the bucket that holds one.")
    folder = os.path.join(cache_folder(),
                          hashlib.sha256(run_url.rstrip("/").encode()).hexdigest()[:16],
                          f"step{step}")
    if not same_checkpoint(folder, run_url, step, key):
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        download(run_url, step, folder, key)
    return folder


def cache_folder():
    """Where checkpoints read from a bucket are cached: NANOGPT_REMOTE_CACHE, default
    ~/.cache/nanogpt-lab/remote."""
    return os.environ.get("NANOGPT_REMOTE_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "nanogpt-lab",
                                                                "remote"))


def same_checkpoint(folder, run_url, step, key):
    """Whether the cached `folder` holds the bucket's step<step> as it is now: its marker (every
    file's checksum) equal to the bucket's. The cache is named by URL and step, and a new run at
    that URL (save_overwrite) or a step uploaded again would otherwise be read from the old copy."""
    try:
        with open(os.path.join(folder, MARKER)) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        return False
    fs, root = filesystem(run_url, key)
    return read_marker(f"{root}/step{step}", fs) == cached


# ----------------------------------------------------------------------------- writing the bucket


class Uploader:
    """Rank 0's background uploads to `url`, one at a time in order, each tried three times.
    `upload_checkpoint` only queues (the loop never waits for the store). A checkpoint stays in
    train.out_dir while it waits (`waiting`: local retention passes over it; `on_done` runs local
    retention once it has gone up), and one that a newer queued checkpoint makes pointless (bucket
    retention would delete it at once) is not uploaded at all. `failures` counts uploads that failed
    every attempt; `lag()` is how long the oldest waiting one has waited. `replaced`: the steps of
    another run this one replaces in the bucket (checkpoint.save_overwrite), made invisible before
    this run's first checkpoint is marked complete and deleted after it: never a mix."""

    def __init__(self, url, keep_last, records=lambda: (), replaced=()):
        self.url, self.keep_last, self.records = url, keep_last, records
        self.fs, self.root = filesystem(url)
        self.replaced = list(replaced)
        # [(step, kind, folder, queued at)], in order; the first is the one being uploaded
        self.pending = []
        self.changed = threading.Condition()
        self.closing = False
        self.failures, self.uploaded_any = 0, False
        self.on_done = lambda: None
        self.thread = threading.Thread(target=self._work, name="checkpoint-upload", daemon=True)
        self.thread.start()

    def upload_checkpoint(self, folder, step, kind):
        """Queue checkpoint `folder` (files, then COMPLETE), then the run's records (config.json,
        metrics.jsonl, ...) beside the checkpoints, then retention in the bucket."""
        with self.changed:
            self.pending.append((step, kind, folder, time.monotonic()))
            self.changed.notify_all()

    def waiting(self):
        """The local checkpoint folders queued or being uploaded: local retention keeps them."""
        with self.changed:
            return {folder for _, _, folder, _ in self.pending}

    def lag(self):
        """Seconds the oldest checkpoint still waiting for its upload has waited (0: the bucket is
        up to date)."""
        with self.changed:
            return time.monotonic() - self.pending[0][3] if self.pending else 0.0

    def wait_idle(self):
        """Until every queued upload has ended (tests, and a run's end)."""
        with self.changed:
            self.changed.wait_for(lambda: not self.pending)

    def _superseded(self, step, kind):
        """Whether a newer queued checkpoint makes this one's upload pointless: bucket retention
        would delete an ephemeral one, or a permanent one with keep_last newer permanent ones, as
        soon as those are up."""
        newer = [k for s, k, _, _ in self.pending if s > step]
        if kind == "ephemeral":
            return bool(newer)
        return (kind == "permanent" and self.keep_last > 0
                and newer.count("permanent") >= self.keep_last)

    def _checkpoint(self, step, folder):
        remote = f"{self.root}/step{step}"
        if self.fs.exists(f"{remote}/{MARKER}"):
            # a step being replaced is incomplete until all is new
            self.fs.rm_file(f"{remote}/{MARKER}")
        with open(os.path.join(folder, MARKER)) as f:
            # every file the marker lists (an FSDP run's: sharded/...)
            names = sorted(json.load(f)["files"])
        for name in names:
            self.fs.put_file(os.path.join(folder, name), f"{remote}/{name}")
        # another run's steps go invisible before this run's first is complete
        for old in self.replaced:
            if self.fs.exists(f"{self.root}/step{old}/{MARKER}"):
                self.fs.rm_file(f"{self.root}/step{old}/{MARKER}")
        self.fs.put_file(os.path.join(folder, MARKER), f"{remote}/{MARKER}")
        # the other run's record goes too (its metrics_step<N>.json...): this run's replaces it
        # whole
        if self.replaced:
            ours = {os.path.basename(path) for path in self.records()}
            for entry in self.fs.ls(self.root, detail=True):
                name = os.path.basename(entry["name"].rstrip("/"))
                if entry["type"] == "file" and name not in ours:
                    self.fs.rm_file(entry["name"])
        self._records()
        for old in self.replaced:
            if old != step:
                self.fs.rm(f"{self.root}/step{old}", recursive=True)
        self.replaced = []
        found = complete_checkpoints(self.fs, self.root)
        for gone in doomed({s: marker.get("kind") for s, marker in found.items()}, self.keep_last):
            self.fs.rm(f"{self.root}/step{gone}", recursive=True)
        # uploads a kill or a failure cut short
        for cut in set(step_folders(self.fs, self.root)) - set(found):
            self.fs.rm(f"{self.root}/step{cut}", recursive=True)

    def _records(self):
        for path in self.records():
            if os.path.exists(path):
                self.fs.put_file(path, f"{self.root}/{os.path.basename(path)}")

    def _upload(self, step, folder):
        for attempt, pause in enumerate((*RETRIES, None)):
            try:
                self._checkpoint(step, folder)
                return
            except Exception as error:  # each store raises its own kinds; the run must go on
                if pause is None:
                    self.failures += 1
                    # (closing: it ended)
                    going_on = "the run is not affected" if self.closing else "training goes on"
                    print(f"warning: uploading checkpoint step{step} to {self.url} failed "
                          f"{attempt + 1} times ({describe_failure(error)}); {going_on}, and the "
                          "checkpoint is in train.out_dir.", file=sys.stderr, flush=True)
                    try:  # what reached the bucket of this step is not a checkpoint: it goes
                        if not self.fs.exists(f"{self.root}/step{step}/{MARKER}"):
                            self.fs.rm(f"{self.root}/step{step}", recursive=True)
                    # noqa: BLE001 - the store is still unreachable: the next upload cleans up
                    except Exception:
                        pass
                else:
                    time.sleep(pause)

    def _work(self):
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.pending or self.closing)
                if not self.pending:
                    break
                step, kind, folder, _ = self.pending[0]
                skip = self._superseded(step, kind)
            if not skip:
                self._upload(step, folder)
                self.uploaded_any = True
            with self.changed:
                self.pending.pop(0)
                self.changed.notify_all()
            self.on_done()
        # at the end, the run's record as the run left it (samples after the last checkpoint)
        if self.uploaded_any:
            try:
                self._records()
            except Exception as error:  # noqa: BLE001 - the record is a copy; the run folder has it
                print(f"warning: the last copy of the run's record to {self.url} failed "
                      f"({describe_failure(error)})",
                      file=sys.stderr, flush=True)

    def close(self, timeout=600.0):
        """Wait (at most `timeout` seconds) for the queued uploads, then stop the thread."""
        with self.changed:
            self.closing = True
            self.changed.notify_all()
        self.thread.join(timeout)
        if self.thread.is_alive():
            print(f"warning: uploads to {self.url} still running after {timeout:.0f} s at exit; "
                  "the bucket may lack the newest checkpoint (train.out_dir has it).",
                  file=sys.stderr, flush=True)


def start_uploads(ck, records, replaced, writer, stack):
    """train.py's start_bookkeeping, on rank 0: the Uploader of checkpoint section `ck`, closed when
    `stack` closes. Uploads that fail after the last row was written are counted in a late row of
    their own (writer.write)."""
    uploader = Uploader(ck.remote_folder, ck.keep_last, records=records, replaced=replaced)

    def report_late_failures():
        if uploader.failures != writer.logged.get("checkpoint/upload_failures", 0):
            writer.write([(writer.last_step, {"checkpoint/upload_failures": uploader.failures})])

    stack.callback(report_late_failures)
    stack.callback(uploader.close)  # runs first: the failures are counted once every upload is done
    return uploader


def rewind(url, step, folder_name):
    """A rewind in the bucket: its checkpoints after `step` move to rewound/<folder_name>/ (copied,
    then removed with their COMPLETE first, so a kill midway leaves no complete checkpoint past
    `step`). Nothing is deleted that is not copied first. Synchronous, at start-up: a restart must
    not download what the rewind put aside."""
    fs, root = filesystem(url)
    for newer in sorted(s for s in complete_checkpoints(fs, root) if s > step):
        source, target = f"{root}/step{newer}", f"{root}/rewound/{folder_name}/step{newer}"
        fs.copy(source, target, recursive=True)
        fs.rm_file(f"{source}/{MARKER}")
        fs.rm(source, recursive=True)
