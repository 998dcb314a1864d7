"""The room an answer runs in: a fresh copy of the project that holds nothing of the teacher's but the project.

grading.py runs every answer in a process of its own (runner.py), and that process starts in this room, not in
the teacher's tree: a temporary folder holding a copy of the project's modules (model.py, train.py, sample.py,
..., config/, tools/) and of exercises/ only what runs an answer: runner.py, and feeding.py with the feed_*.py
modules, which build what the answer is given and send back what it returns. It holds no answer file of the
teacher's (the references), no solutions/, no hints.py, no tests, and none of the checks (checks_*.py,
checking.py, check.py, grading.py): what grades (the expected values, the comparisons, the advice) never lies
where an answer runs, so an answer can neither read the truth from it nor rewrite it. Each answer gets a folder of
its own beside it holding copies of the student's answer files (an answer may build on another: 16 on 10) and the
inputs. So the answer's `import model` is the room's model.py, and `Path(exercises.__file__).parent` is the room's
exercises/, where no reference lies.

What else holds the answer in, by platform (runner.py's `isolate`, run in the answer's process before the
answer file loads):
- Linux, grader run as root: the answer's process gets a mount namespace of its own in which the teacher's
  project folder is covered by an empty, unreadable folder, then drops to an unprivileged user id of the answer's
  own (`unprivileged`; `nobody` where none is free), who
  may write only its own folder and /tmp. So the teacher's tree can be neither read nor written.
- Linux as another user, macOS, other Unixes: the room only. The answer runs with the grader's rights, so it
  could still find the teacher's tree by its absolute path; `fingerprint` (below) then catches any change to
  the grading files, and check.py refuses the grade, naming the file.
- Windows (no fork): the same, each answer in a fresh `python runner.py` in the room.
"""

import atexit
import hashlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the teacher's project: the copy that grades

# Of exercises/, what the answer's process needs: the runner and the feed modules (feeding.py, feed_*.py), which
# hold no expected value, comparison or advice. Nothing else of exercises/ goes in.
RUNS_ANSWERS = ("exercises/__init__.py", "exercises/grader/__init__.py", "exercises/grader/runner.py",
                "exercises/grader/feeding.py")


def kept(name):
    """Whether project file `name` (relative, with /) goes into the room."""
    parts = name.split("/")
    if parts[0] in ("tests", "docs", ".github"):
        return False
    if parts[0] != "exercises":
        return True
    return name in RUNS_ANSWERS or (parts[1:2] == ["grader"] and len(parts) == 3
                                    and parts[2].startswith("feed_") and parts[2].endswith(".py"))


def project_files(root=ROOT):
    from exercises.grader.make_student_copy import project_files as listed

    return [name for name in listed(root) if kept(name.replace(os.sep, "/"))]


# The user ids an answer may run as: above those systems give to people and services (up to 60000, and nobody at
# 65534), and within what this process's user namespace maps (/proc/self/uid_map).
ANSWER_IDS = (100_000, 2**31 - 1)


def unprivileged():
    """(uid, gid) an answer runs as when the grader is root on Linux: a new pair for each answer, which no user and
    no other process has; None elsewhere. A process the answer leaves running (a double fork, setsid) keeps that
    id, so it is found and stopped when the answer ends (`stop_leftovers`), and no later answer's folder, owned by
    another id, is open to it. Where the namespace maps no such id, `nobody` (and leftovers are not stopped)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return None
    import pwd
    import random

    ranges = []
    with open("/proc/self/uid_map") as f:
        for line in f:
            inside, _, count = map(int, line.split())
            low, high = max(inside, ANSWER_IDS[0]), min(inside + count, ANSWER_IDS[1])
            ranges += [(low, high)] * (low < high)
    taken = {entry.pw_uid for entry in pwd.getpwall()}
    for _ in range(100):
        if not ranges:
            break
        uid = random.SystemRandom().randrange(*random.choice(ranges))
        if uid not in taken and not processes_of(uid):
            return uid, uid
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def processes_of(uid):
    """The pids of the processes running with `uid` as their real, effective or saved user id (Linux's /proc)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                ids = next(line for line in f if line.startswith("Uid:")).split()[1:4]
        except (OSError, StopIteration, ValueError):
            continue  # not a process, or one that ended meanwhile
        if str(uid) in ids:
            found.append(int(name))
    return found


def stop_leftovers(user):
    """Stop every process still running as the answer's own `user` once the answer has ended: what it started and
    left behind, which could otherwise rewrite a later answer before it loads. Nothing when `user` is shared
    (nobody) or None."""
    if user is None or user[0] < ANSWER_IDS[0]:
        return
    for _ in range(20):  # a process that forks as fast as it is stopped is stopped again
        found = processes_of(user[0])
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def give_to_answer(folder, user):
    """Make `folder` (an answer's own) writable by the user the answer runs as (None: it runs as the grader)."""
    if user is None:
        return
    for path in [Path(folder), *Path(folder).rglob("*")]:
        os.chown(path, *user)


class Room:
    """The room, built at the first answer and removed when this process ends."""

    def __init__(self):
        self.path, self.data = None, {}

    def build(self):
        if self.path is None:
            path = Path(tempfile.mkdtemp(prefix="exercise-room-"))
            atexit.register(shutil.rmtree, path, True)
            for name in project_files():
                target = path / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, target)
            for folder in [path, *(p for p in path.rglob("*") if p.is_dir())]:
                folder.chmod(0o755)  # readable by the answer's user, writable by none but this process
            self.path = path
        return self.path

    def data_root(self, data_root):
        """A copy in the room of `data_root`'s prepared Shakespeare (prepared first if it is not yet), for the
        answers that train: the answer's process cannot read the teacher's data/, nor write it."""
        from data import dataset_dir
        from prepare_data import ensure_dataset

        source = dataset_dir(str(data_root), "shakespeare")
        if source not in self.data:
            ensure_dataset(source)
            copy = self.build() / "data" / f"{len(self.data)}"
            shutil.copytree(source, copy / "shakespeare")
            for folder in (copy.parent, copy, copy / "shakespeare"):
                folder.chmod(0o755)
            self.data[source] = str(copy)
        return self.data[source]


ROOM = Room()


def answer_folder(graded):
    """A new folder of one answer's own, beside the room: copies of the answer files in `graded` (the
    student's exercises/), under exercises/ so the answer's messages name them as the student knows them."""
    folder = tempfile.TemporaryDirectory(prefix="exercise-answer-")
    (Path(folder.name) / "exercises").mkdir()
    for path in Path(graded).glob("[0-9][0-9]_*.py"):
        shutil.copy(path, Path(folder.name) / "exercises" / path.name)
    return folder


# ----------------------------------------------------------------------------- the grading files, before and after


def fingerprint(root=None):
    """{file: sha256} of what grades in `root`: the project's modules and exercises/ (the checks, the runner, the
    reference answers), so a change made while an answer ran is caught whatever the platform let it do."""
    root, hashes = Path(root or ROOT), {}
    folders = [root, root / "exercises", root / "exercises" / "grader", root / "config"]
    for name in sorted(path for folder in folders for path in folder.glob("*.py")):
        hashes[str(name.relative_to(root))] = hashlib.sha256(name.read_bytes()).hexdigest()
    return hashes


def changed_file(before, after):
    """The first grading file that differs between two fingerprints (added, removed or changed), or None."""
    return next((name for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)), None)
