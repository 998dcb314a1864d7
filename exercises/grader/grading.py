"""How a check meets an answer without sharing a process with it: grading a student cannot change.

The teacher's check.py computes every reference (model.py's outputs and gradients, torch's AdamW, tiktoken's
ids, one process's DDP step, ...) in its own process, which never imports an answer file. An answer runs in a
process of its own, started in the room (room.py): a fresh copy of the project without the teacher's answers,
solutions or hints, where the answer's `import model` is the room's model.py and the teacher's tree is not on
the path (on Linux as root, not even readable, and the answer's user cannot write it). There the room's
runner.py loads a copy of the answer file, runs the check's answer side on the inputs the check saved, and
saves what came back as plain data. The check loads that with torch.load(weights_only=True), which reads
tensors, numbers and strings and runs no code. So an answer file that patches torch or the project changes
only its own process; and nothing of the student's copy but its answer files runs at all (not its check.py,
checking.py, checks or project modules). Answers run one after another, each in a child forked by one zygote
(runner.py says why); under torchrun, two per answer.
"""

import ast
import atexit
import io
import json
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import torch

from exercises.grader.checking import ExerciseFailed, NotDone
from exercises.grader.room import ROOM, ROOT, answer_folder, give_to_answer, stop_leftovers, unprivileged

HERE = Path(__file__).resolve().parents[1]  # the grading copy's exercises/


def answer_file(number, folder=HERE):
    """exercises/NN_name.py of exercise `number` in `folder`."""
    found = sorted(Path(folder).glob(f"{number:02d}_*.py"))
    if not found:
        raise ExerciseFailed(f"{folder} holds no {number:02d}_*.py, the answer file of exercise {number}.")
    return found[0].resolve()


def blank_bodies(source):
    """The names (function, or Class.method) whose body is still the student copy's `raise NotImplementedError`,
    in the order of the file: read from the source text, without running it."""
    names = []
    for node in ast.parse(source).body:
        members = []
        if isinstance(node, ast.FunctionDef):
            members = [(node, "")]
        elif isinstance(node, ast.ClassDef):
            members = [(method, f"{node.name}.") for method in node.body if isinstance(method, ast.FunctionDef)]
        for function, prefix in members:
            body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0]):
                names.append(prefix + function.name)
    return names


class Answers:
    """The answer file of exercise `number` in `folder`, graded from outside: its functions run only in a
    process of their own (`run`), and only their results come back."""

    def __init__(self, number, folder=HERE):
        self.number, self.folder = number, Path(folder).resolve()
        self.path = answer_file(number, self.folder)

    def check_written(self):
        """NotDone, without running anything, when an answer function is still blank."""
        try:
            blank = blank_bodies(self.path.read_text(encoding="utf-8"))
        except SyntaxError as error:
            raise ExerciseFailed(f"exercises/{self.path.name} does not load ({error.msg} at line {error.lineno}).") \
                from None
        if blank:
            raise NotDone(f"write {blank[0]} in exercises/{self.path.name} (its docstring says what it must do).")

    def run(self, side, inputs=None, timeout=300, ranks=1):
        """`side(answers, inputs)` (a function of a feed module, feed_*.py) in a new process that loads the answer file;
        returns what it returned, as plain data. With ranks=2, torchrun starts two such processes on gloo (the
        checks of data parallelism), and rank 0's result comes back."""
        return self.start(side, inputs, timeout, ranks).result()

    def start(self, side, inputs=None, timeout=300, ranks=1):
        """`run`, started: the check computes its reference meanwhile, then calls `.result()`."""
        return Running(self, side, inputs, timeout, ranks)

    @staticmethod
    def data_root(data_root):
        """The data root to give an answer side that trains: a copy in the room of `data_root`'s Shakespeare."""
        return ROOM.data_root(data_root)


class Running:
    """An answer process (or two, under torchrun) under way."""

    def __init__(self, answers, side, inputs, timeout, ranks):
        self.answers, self.timeout, self.ranks = answers, timeout, ranks
        # In a folder of its own, beside the room, holding copies of the answer files: nothing the answer writes
        # lands in the project, and it reads no answer file but the student's.
        self.folder = answer_folder(answers.folder)
        self.inputs, self.outputs = (os.path.join(self.folder.name, name) for name in ("in.pt", "out.pt"))
        torch.save(inputs, self.inputs)
        self.user = unprivileged()  # (uid, gid) of this answer's own, or None (runner.isolate, room.py)
        give_to_answer(self.folder.name, self.user)
        job = [str(Path(self.folder.name) / "exercises" / answers.path.name), f"{side.__module__}:{side.__name__}",
               self.inputs, self.outputs]
        if hasattr(os, "fork"):
            self.process = None
            self.child = ZYGOTE.start(job, self.folder.name, ranks, self.user)
            return
        start = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={ranks}"]
        self.process = subprocess.Popen(start + [str(ROOM.build() / "exercises" / "grader" / "runner.py"), *job],
                                        cwd=self.folder.name, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=runner_environment())

    def wait(self):
        """(exit status, its output), or None when the answer ran past the time limit (and was stopped)."""
        if self.process is None:
            status = ZYGOTE.wait(self.child, self.timeout)
            output = written_by_answer(self.folder.name, "output.txt") or b""
            return None if status is None else (status, output.decode(errors="replace"))
        try:
            output = self.process.communicate(timeout=self.timeout)[0]
            return self.process.returncode, output
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            return None

    def result(self):
        try:
            finished = self.wait()
            if finished is None:
                raise ExerciseFailed(f"your answer did not finish in {self.timeout} s (the check's inputs are small: "
                                     f"look for a loop that never ends, or a rank that waits for another).")
            status, output = finished
            # Each rank writes its own file (rank 0: out.pt); when rank 0 could not, another rank's says why.
            names = ["out.pt"] + [f"out.pt.{r}" for r in range(1, self.ranks)]
            written = [data for data in (written_by_answer(self.folder.name, name) for name in names) if data]
            if not written:
                lines = [line for line in output.strip().splitlines() if line.strip()] or ["no output"]
                raise ExerciseFailed(f"the process that runs your answer ended (exit status {status}) before it "
                                     f"answered: {lines[-1][:200]}.")
            try:
                came_back = torch.load(io.BytesIO(written[0]), weights_only=True)
            except Exception:  # noqa: BLE001 - whatever the file holds, it is not what runner.py saves
                came_back = None
        finally:
            stop_leftovers(self.user)  # what the answer left running goes before its folder does
            self.folder.cleanup()
        if not isinstance(came_back, dict):
            raise ExerciseFailed("the process that runs your answer sent back something else than its results.")
        if "not_done" in came_back:
            raise NotDone(str(came_back["not_done"]))
        if "failed" in came_back:
            raise ExerciseFailed(str(came_back["failed"]))
        return came_back.get("outputs")


def written_by_answer(folder, name):
    """The bytes of the file `name` in the answer's own `folder`, or None when there is no such plain file. The
    answer's user owns the folder, so it may have put there, in the file's place, a link to a file only the grader
    can read (which the grader would then print) or a pipe (which would hold the grader forever): neither is
    followed or waited on. The folder itself is opened without following a link either."""
    no_follow = getattr(os, "O_NOFOLLOW", 0)
    if os.open not in os.supports_dir_fd:  # (Windows: the answer runs as the grader, with nothing more to reach)
        path = os.path.join(folder, name)
        return Path(path).read_bytes() if os.path.isfile(path) else None
    try:
        folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | no_follow)
    except OSError:
        return None
    try:
        fd = os.open(name, os.O_RDONLY | no_follow | os.O_NONBLOCK, dir_fd=folder_fd)
    except OSError:
        return None
    finally:
        os.close(folder_fd)
    with os.fdopen(fd, "rb") as f:
        found = os.fstat(fd)
        return f.read() if stat.S_ISREG(found.st_mode) and found.st_nlink == 1 else None


def runner_environment():
    """The environment of an answer's process: one thread, and no PYTHONPATH that could put a student's copy
    before this one."""
    return {**{name: value for name, value in os.environ.items() if name != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}


class Zygote:
    """runner.py --zygote, started at the first answer and kept until this process ends: each answer runs in a
    child it forks (runner.py says why). One answer at a time: a new one waits for the last to end. Its replies
    are read by a thread into a queue, so that waiting for one can end after a time limit."""

    def __init__(self):
        self.process, self.replies, self.running = None, None, None

    def start(self, job, folder, ranks=1, user=None):
        """Start `job` in a new child (torchrun's, with ranks > 1), shut in (runner.isolate) as `user`; returns its
        pid."""
        if self.running is not None:  # a check that stopped before reading its answer's end
            self.wait(self.running, None)
        if self.process is None or self.process.poll() is not None:
            room = ROOM.build()
            self.process = subprocess.Popen([sys.executable, str(room / "exercises" / "grader" / "runner.py"), "--zygote"],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                            text=True, env=runner_environment(), cwd=room)
            self.replies = queue.Queue()
            threading.Thread(target=self.read, args=(self.process.stdout, self.replies), daemon=True).start()
            atexit.register(self.process.stdin.close)
        request = {"job": job, "folder": folder, "ranks": ranks, "hidden": [str(ROOT)], "user": user}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        self.running = self.reply(None)["pid"]
        return self.running

    def wait(self, pid, timeout):
        """The child's exit status, or None after `timeout` seconds (the child is then stopped)."""
        try:
            status = self.reply(timeout)["status"]
        except queue.Empty:
            os.killpg(pid, signal.SIGKILL)  # the child leads a process group: torchrun's ranks go with it
            self.reply(None)
            status = None
        self.running = None
        return status

    def reply(self, timeout):
        line = self.replies.get(timeout=timeout)
        if line is None:
            self.process, self.running = None, None
            raise ExerciseFailed("the process that runs the answers ended: run the check again.")
        return json.loads(line)

    @staticmethod
    def read(stdout, replies):
        for line in stdout:
            replies.put(line)
        replies.put(None)


ZYGOTE = Zygote()
