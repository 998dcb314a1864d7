"""The room an answer runs in: a fresh copy of the project that holds nothing of the teacher's but
the project.

grading.py runs every answer in a process of its own (runner.py), and that process starts in this
room, not in the teacher's tree: a temporary folder holding a copy of the project's modules
(model.py, train.py, sample.py, ..., config/, tools/) and of exercises/ only what runs an answer:
grader/runner.py, and grader/feeding.py with the feed_*.py modules, which build what the answer is
given and send back what it returns. It holds no answer file of the teacher's (the references), no
solutions/, no hints, no tests, and none of the checks (checks_*.py, checking.py, check.py,
grading.py): what grades (the expected values, the comparisons, the advice) never lies where an
answer runs, so an answer can neither read the truth from it nor rewrite it. Each answer gets a
folder of its own beside it holding copies of the student's answer files (an answer may build on
another: 16 on 10) and the inputs. So the answer's `import model` is the room's model.py, and
`Path(exercises.__file__).parent` is the room's exercises/, where no reference lies. Exercise 16,
the capstone, has a room of its own, whose model.py keeps GPTConfig and what the trainer asks every
GPT but not the modules the student writes (`without_the_capstone`).

What else holds the answer in, by platform (runner.py, in the answer's process before the answer
file loads):
- Linux with bubblewrap (sandbox.py): the room and Python read-only, nothing else of the disk, no
  network, a PID namespace of each answer's own; as root, a user id of the answer's own
  (`unprivileged`), who may write only its own folder and a /tmp of its own.
- Linux without bubblewrap, grader run as root: the answer's process gets a mount namespace of its
  own in which the teacher's project folder is covered by an empty, unreadable folder and /tmp by a
  fresh one (runner.fresh_tmp), a PID namespace, and a user id of its own. So the teacher's tree can
  be neither read nor written, nor the machine's /tmp; other folders open to every user are.
- Linux as another user without bubblewrap, macOS, other Unixes: the room only. The answer runs with
  the grader's rights, so it could still find the teacher's tree by its absolute path;
  `fingerprint` (below) then catches any change to the grading files, and check.py refuses the
  grade, naming the file.
- Windows (no fork): the same, each answer in a fresh `python runner.py` in the room.
"""

import atexit
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the teacher's project: the copy that grades

# Of exercises/, what the answer's process needs: the runner and the feed modules (feeding.py,
# feed_*.py), which hold no expected value, comparison or advice. Nothing else of exercises/ goes
# in.
RUNS_ANSWERS = ("exercises/__init__.py", "exercises/grader/__init__.py",
                "exercises/grader/runner.py", "exercises/grader/feeding.py")


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


# The user ids an answer may run as: above those systems give to people and services (up to 60000,
# and nobody at 65534), and within what this process's user namespace maps (/proc/self/uid_map).
ANSWER_IDS = (100_000, 2**31 - 1)


def unprivileged():
    """(uid, gid) an answer runs as when the grader is root on Linux: a new pair for each answer,
    which no user and no other process has; None elsewhere. No later answer's folder, owned by
    another id, is open to it. Where the namespace maps no such id, `nobody`."""
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
    """The pids of the processes running with `uid` as their real, effective or saved user id
    (Linux's /proc)."""
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


def give_to_answer(folder, user):
    """Make `folder` (an answer's own) writable by the user the answer runs as (None: it runs as the
    grader)."""
    if user is None:
        return
    for path in [Path(folder), *Path(folder).rglob("*")]:
        os.chown(path, *user)


class Room:
    """A room, built at its first answer and removed when this process ends; `capstone`: exercise
    16's."""

    def __init__(self, capstone=False):
        self.capstone, self.path, self.data, self.folders = capstone, None, {}, None

    def build(self):
        if self.path is None:
            path = Path(tempfile.mkdtemp(prefix="exercise-room-"))
            atexit.register(shutil.rmtree, path, True)
            for name in project_files():
                target = path / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, target)
            if self.capstone:
                model = without_the_capstone((ROOT / "model.py").read_text())
                (path / "model.py").write_text(model)
            for folder in [path, *(p for p in path.rglob("*") if p.is_dir())]:
                # readable by the answer's user, writable by none but this process
                folder.chmod(0o755)
            self.path = path
        return self.path

    def answers(self):
        """The folder of the answers' own folders: beside the room, the one folder an answer may
        write."""
        if self.folders is None:
            self.folders = Path(tempfile.mkdtemp(prefix="exercise-answers-"))
            self.folders.chmod(0o711)  # each answer enters its own folder, and lists none
            atexit.register(shutil.rmtree, self.folders, True)
        return self.folders

    def data_root(self, data_root):
        """A copy in the room of `data_root`'s prepared Shakespeare (prepared first if it is not
        yet), for the answers that train: the answer's process cannot read the teacher's data/, nor
        write it."""
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


ROOMS = {"project": Room(), "capstone": Room(capstone=True)}


def room_for(number):
    """The room exercise `number`'s answers run in."""
    return ROOMS["capstone" if number == 16 else "project"]


# What exercise 16 asks the student to write, which its room's model.py does not hold.
CAPSTONE_MODULES = ("CausalSelfAttention", "MLP", "Block")
CAPSTONE_METHODS = ("__init__", "_init_weights", "forward", "hidden_states")  # of GPT


def without_the_capstone(source):
    """model.py's `source` without what the capstone asks the student to write: the attention, MLP
    and block classes are gone (importing one is one sentence), and GPT keeps what the trainer asks
    every GPT (logits, param_groups, the counts) but not its own construction and forward, which
    raise the same sentence."""
    import ast

    lines = source.splitlines()
    cut = []  # (first line, last line, replacement) of the source, bottom up
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in CAPSTONE_MODULES:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            cut.append((first, node.end_lineno, []))
        if isinstance(node, ast.ClassDef) and node.name == "GPT":
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name in CAPSTONE_METHODS:
                    indent = " " * method.body[0].col_offset
                    cut.append((method.body[0].lineno, method.end_lineno,
                                [f"{indent}raise CapstoneIsYours('GPT.{method.name}')"]))
    for first, last, replacement in sorted(cut, reverse=True):
        lines[first - 1:last] = replacement
    return "\n".join(lines) + CAPSTONE_STUB


CAPSTONE_STUB = '''


class CapstoneIsYours(ImportError):
    """Exercise 16's answer reached for model.py's modules, which the student is to write."""

    capstone = True  # (runner.describe_error says this one as it is)

    def __init__(self, name):
        super().__init__(f"the capstone is yours to write: exercises/16_gpt.py uses model.py's "
                         f"{name}, which exercise 16 does not give; write your own from your parts "
                         f"of exercise 10")


def __getattr__(name):
    if name in ("CausalSelfAttention", "MLP", "Block"):
        raise CapstoneIsYours(name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
'''


def answer_folder(graded, parent):
    """A new folder of one answer's own in `parent` (Room.answers), holding copies of the answer
    files in `graded` (the student's exercises/), under exercises/ so the answer's messages name
    them as the student knows them. Only the course's answer files go (the names of the teacher's):
    a file of the student's own there, say model.py saved as 99_model.py, would let an answer
    import the project's code where the exercise is to write it."""
    folder = tempfile.TemporaryDirectory(prefix="exercise-answer-", dir=parent)
    (Path(folder.name) / "exercises").mkdir()
    for name in answer_names():
        if (Path(graded) / name).is_file():
            shutil.copy(Path(graded) / name, Path(folder.name) / "exercises" / name)
    return folder


def answer_names():
    """The names of the course's answer files (exercises/NN_name.py of the teacher's copy)."""
    return sorted(path.name for path in (ROOT / "exercises").glob("[0-9][0-9]_*.py"))


# ------------------------------------------------------------ the grading files, before and after


def fingerprint(root=None):
    """{file: sha256} of what grades in `root`: the project's modules and exercises/ (the checks,
    the runner, the reference answers), so a change made while an answer ran is caught whatever the
    platform let it do."""
    root, hashes = Path(root or ROOT), {}
    folders = [root, root / "exercises", root / "exercises" / "grader", root / "config"]
    for name in sorted(path for folder in folders for path in folder.glob("*.py")):
        hashes[str(name.relative_to(root))] = hashlib.sha256(name.read_bytes()).hexdigest()
    return hashes


def changed_file(before, after):
    """The first grading file that differs between two fingerprints (added, removed or changed), or
    None."""
    names = sorted(set(before) | set(after))
    return next((name for name in names if before.get(name) != after.get(name)), None)
