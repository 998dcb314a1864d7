"""How a check meets an answer without sharing a process with it: grading a student cannot change.

The teacher's check.py computes every reference (model.py's outputs and gradients, torch's AdamW,
tiktoken's ids, one process's DDP step, ...) in its own process, which never imports an answer file.
An answer runs in a process of its own, started in the room (room.py): a fresh copy of the project
without the teacher's answers, solutions or hints, where the answer's `import model` is the room's
model.py and the teacher's tree is not on the path (on Linux as root, not even readable, and the
answer's user cannot write it). There the room's runner.py loads a copy of the answer file, runs the
check's answer side on the inputs the check saved, and saves what came back as plain data. The check
loads that with torch.load(weights_only=True), which reads tensors, numbers and strings and runs no
code. So an answer file that patches torch or the project changes only its own process; and nothing
of the student's copy but its answer files runs at all (not its check.py, checking.py, checks or
project modules). Answers run one after another, each in a child forked by one zygote (runner.py
says why); under torchrun, two per answer."""

import ast
import atexit
import io
import itertools
import json
import os
import queue
import secrets
import stat
import subprocess
import sys
import threading
from pathlib import Path

import torch

from exercises.grader.checking import ExerciseFailed, GraderFailed, NotDone, from_the_answer
from exercises.grader.room import ROOT, answer_folder, give_to_answer, room_for, unprivileged
from exercises.grader.sandbox import (CGROUP_MEMORY, ENVIRONMENT, FOLDER_BYTES, TMP_BYTES, Cgroup,
                                      Sandbox)

HERE = Path(__file__).resolve().parents[1]  # the grading copy's exercises/


def answer_file(number, folder=HERE):
    """exercises/NN_name.py of exercise `number` in `folder`."""
    found = sorted(Path(folder).glob(f"{number:02d}_*.py"))
    if not found:
        raise ExerciseFailed(f"{folder} holds no {number:02d}_*.py, the answer file of exercise "
                             f"{number}.")
    return found[0].resolve()


def blank_bodies(source):
    """The names (function, or Class.method) whose body is still the student copy's `raise
    NotImplementedError`, in the order of the file: read from the source text, without running it.
    """
    names = []
    for node in ast.parse(source).body:
        members = []
        if isinstance(node, ast.FunctionDef):
            members = [(node, "")]
        elif isinstance(node, ast.ClassDef):
            members = [(method, f"{node.name}.") for method in node.body
                       if isinstance(method, ast.FunctionDef)]
        for function, prefix in members:
            body = [s for s in function.body
                    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) == 1 and isinstance(body[0], ast.Raise) and \
                    "NotImplementedError" in ast.unparse(body[0]):
                names.append(prefix + function.name)
    return names


class Answers:
    """The answer file of exercise `number` in `folder`, graded from outside: its functions run only
    in a process of their own (`run`), and only their results come back."""

    def __init__(self, number, folder=HERE):
        self.number, self.folder = number, Path(folder).resolve()
        self.path = answer_file(number, self.folder)

    def check_written(self):
        """NotDone, without running anything, when an answer function is still blank."""
        try:
            blank = blank_bodies(self.path.read_text(encoding="utf-8"))
        except SyntaxError as error:
            raise ExerciseFailed(f"exercises/{self.path.name} does not load ({error.msg} at line "
                                 f"{error.lineno}).") \
                from None
        if blank:
            raise NotDone(f"write {blank[0]} in exercises/{self.path.name} (its docstring says "
                          "what it must do).")

    def run(self, side, inputs=None, timeout=300, ranks=1, cpu=None):
        """`side(answers, inputs)` (a function of a feed module, feed_*.py) in a new process that
        loads the answer file; returns what it returned, as plain data. With ranks=2, torchrun
        starts two such processes on gloo (the checks of data parallelism), and rank 0's result
        comes back. `cpu`: seconds of CPU the answer's processes may use together, past which
        `OverCpu` is raised."""
        return self.start(side, inputs, timeout, ranks, cpu).result()

    def start(self, side, inputs=None, timeout=300, ranks=1, cpu=None):
        """`run`, started: the check computes its reference meanwhile, then calls `.result()`."""
        return Running(self, side, inputs, timeout, ranks, cpu)

    def shared_folder(self):
        """The folder the answer's process shares with this one (the answers' folders): a Unix
        socket made there (checks_ddp.py) is the one way to talk to the grader from the sandbox,
        which has no network."""
        return room_for(self.number).answers()

    def data_root(self, data_root):
        """The data root to give an answer side that trains: a copy in the room of `data_root`'s
        Shakespeare."""
        return room_for(self.number).data_root(data_root)


class OverCpu(ExerciseFailed):
    """The answer's processes used more than the CPU they were given (`cpu` seconds, measured:
    `used`)."""

    def __init__(self, cpu, used):
        super().__init__(f"your answer used more than {cpu:.3g} s of CPU, the most this check "
                         "gives it: look for "
                         f"work done again and again.")
        self.cpu, self.used = cpu, used


class Running:
    """An answer process (or two, under torchrun) under way."""

    def __init__(self, answers, side, inputs, timeout, ranks, cpu):
        self.answers, self.timeout, self.ranks, self.cpu = answers, timeout, ranks, cpu
        room = room_for(answers.number)
        # In a folder of its own, beside the room, holding copies of the answer files: nothing the
        # answer writes lands in the project, and it reads no answer file but the student's.
        self.folder = answer_folder(answers.folder, room.answers())
        self.inputs, self.outputs = (os.path.join(self.folder.name, name)
                                     for name in ("in.pt", "out.pt"))
        torch.save(inputs, self.inputs)
        # (uid, gid) of the answer's own, or None
        self.user = None if sandbox().as_grader else unprivileged()
        # where it runs as the grader (root, Python closed to others), a user id its processes are
        # counted as, but torchrun's ranks' (runner.count_as)
        counted = unprivileged() if self.user is None and ranks == 1 else None
        give_to_answer(self.folder.name, self.user)
        # printed by the runner right before it loads the answer (runner.py says why)
        self.mark = f"answer-loading-{secrets.token_hex(16)}"
        job = [str(Path(self.folder.name) / "exercises" / answers.path.name),
               f"{side.__module__}:{side.__name__}", self.inputs, self.outputs, self.mark]
        if hasattr(os, "fork"):
            self.process = None
            self.zygote = zygote_of(room)
            self.zygote.start({"job": job, "folder": self.folder.name, "ranks": ranks,
                               "user": self.user, "counted_as": counted and counted[0],
                               "timeout": timeout, "cpu": cpu,
                               "no_fork": cpu is not None, "environment": ENVIRONMENT,
                               "folder_bytes": FOLDER_BYTES, "tmp_bytes": TMP_BYTES})
            return
        start = [sys.executable]
        if ranks > 1:
            start += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        runner = room.build() / "exercises" / "grader" / "runner.py"
        self.process = subprocess.Popen(start + [str(runner), *job], cwd=self.folder.name,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        env=answer_environment(self.folder.name))

    def wait(self):
        """{"status": exit status or None, "limit": "time" or "cpu" when the answer was stopped at
        one, "loaded": whether the runner got as far as loading the answer, "output": the end of
        what it printed}."""
        if self.process is None:
            return self.zygote.wait(self.timeout)
        try:
            output = self.process.communicate(timeout=self.timeout)[0]
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            return {"status": None, "limit": "time", "output": "", "loaded": True}
        mark = f"\n{self.mark}\n".encode()
        return {"status": self.process.returncode, "limit": None, "loaded": mark in output,
                "output": output.replace(mark, b"", 1)[-16_384:].decode(errors="replace")}

    def result(self):
        try:
            ended = self.wait()
            if ended["limit"] == "time":
                raise ExerciseFailed(f"your answer did not finish in {self.timeout} s (the check's "
                                     "inputs are small: "
                                     "look for a loop that never ends, or a rank that waits for "
                                     "another).")
            if ended["limit"] == "cpu":
                raise OverCpu(self.cpu, ended["cpu"])
            if self.cpu is not None and (ended.get("all_cpu") or 0) > self.cpu:
                raise OverCpu(self.cpu, ended["all_cpu"])
            if ended.get("memory"):
                raise ExerciseFailed(f"your answer's processes together used more than "
                                     f"{CGROUP_MEMORY / 2**30:.3g} GB of memory, the most an "
                                     "answer may have: look for data kept that is no longer "
                                     "needed, or copies.")
            if ended.get("disk_full"):
                raise ExerciseFailed("your answer filled its folder, "
                                     f"{FOLDER_BYTES / 2**20:.0f} MB in all, the most an answer "
                                     "may write: write only what the exercise asks for.")
            if ended.get("tmp_full"):
                raise ExerciseFailed(f"your answer filled /tmp, {TMP_BYTES / 2**20:.0f} MB, the "
                                     "most an answer may write there: write only what the "
                                     "exercise asks for, and remove what you no longer need.")
            # Each rank writes its own file (rank 0: out.pt); when rank 0 could not, another rank's
            # says why.
            names = ["out.pt"] + [f"out.pt.{r}" for r in range(1, self.ranks)]
            written = [written_by_answer(self.folder.name, name) for name in names]
            written = [data for data in written if data]
            if not written:
                # (on new lines only: splitlines would also cut at separators the answer chose)
                lines = [line for line in ended["output"].split("\n") if line.strip()]
                lines = lines or ["no output"]
                last = from_the_answer(lines[-1])
                if not ended["loaded"]:  # the grader's failure: the answer never ran
                    raise GraderFailed("the process that runs your answer ended (exit status "
                                       f"{ended['status']}) "
                                       f"before it loaded the answer: {last}")
                raise ExerciseFailed("the process that runs your answer ended (exit status "
                                     f"{ended['status']}) "
                                     f"before it answered: {last}.")
            try:
                came_back = torch.load(io.BytesIO(written[0]), weights_only=True)
            except Exception:  # noqa: BLE001 - whatever it holds, it is not what runner.py saves
                came_back = None
        finally:
            self.folder.cleanup()
        if not isinstance(came_back, dict):
            raise ExerciseFailed("the process that runs your answer sent back something else than "
                                 "its results.")
        if "not_done" in came_back:
            raise NotDone(from_the_answer(came_back["not_done"]))
        if "failed" in came_back:
            raise ExerciseFailed(from_the_answer(came_back["failed"]))
        return came_back.get("outputs")


def written_by_answer(folder, name):
    """The bytes of the file `name` in the answer's own `folder`, or None when there is no such
    plain file. The answer's user owns the folder, so it may have put there, in the file's place, a
    link to a file only the grader can read (which the grader would then print) or a pipe (which
    would hold the grader forever): neither is followed or waited on. The folder itself is opened
    without following a link either."""
    no_follow = getattr(os, "O_NOFOLLOW", 0)
    if os.open not in os.supports_dir_fd:  # (Windows: the answer runs as the grader)
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


def answer_environment(home):
    """The whole environment of an answer's process: what it needs (sandbox.ENVIRONMENT), its HOME,
    and on Windows what Python needs to start; nothing else of the grader's (no keys, no
    PYTHONPATH)."""
    kept = {name: os.environ[name] for name in ("SYSTEMROOT", "WINDIR", "PATH")
            if os.name == "nt" and name in os.environ}
    return {**ENVIRONMENT, **kept, "HOME": home}


# the Sandbox of this process, made at the first answer (check.py's --no-bwrap makes its own first)
SANDBOX = []


def sandbox(use_bwrap=True):
    """This process's Sandbox; the first call says, in one line on stderr, where the answers run."""
    if not SANDBOX:
        SANDBOX.append(Sandbox(use_bwrap))
        line = SANDBOX[0].describe()
        if line:
            print(line, file=sys.stderr, flush=True)
    return SANDBOX[0]


class Zygote:
    """runner.py --zygote in a room, started at the first answer and kept until this process ends,
    in the sandbox where bwrap starts: each answer runs under a watcher it forks (runner.py says
    why). One answer at a time: a new one waits for the last to end. Its replies are read by a
    thread into a queue, so that waiting for one can end after a time limit."""

    def __init__(self, room):
        self.room, self.process, self.replies, self.running = room, None, None, False

    def start(self, request):
        """Start the job of `request` (runner.zygote says what it holds) under a new watcher."""
        if self.running:  # a check that stopped before reading its answer's end
            self.wait(None)
        if self.process is None or self.process.poll() is not None:
            self.launch()
        box = sandbox()
        if box.bwrap is None:  # the room alone: the answer's process hides the teacher's tree
            request["room_only"] = {"hidden": [str(ROOT)], "python": [str(p) for p in box.python]}
        # what the answer's fresh /tmp keeps of the old one, where they lie there (runner.fresh_tmp)
        request["tmp_kept"] = [str(p) for p in (self.room.build(), self.room.answers(),
                                                *box.python)]
        self.oom_kills, self.cpu_before = self.cgroup.oom_kills(), self.cgroup.cpu_seconds()
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        self.reply(60)  # {"pid": the watcher's}
        self.running = True

    def launch(self):
        room, box = self.room.build(), sandbox()
        runner = room / "exercises" / "grader" / "runner.py"
        command = [sys.executable, str(runner), "--zygote"]
        if box.bwrap:
            command = box.command(sys.executable, runner, room, self.room.answers())
        # the zygote and each answer together, where a cgroup may be made (root)
        self.cgroup = Cgroup(f"exercise-grading-{os.getpid()}-{next(LAUNCHES)}")
        self.process = subprocess.Popen(self.cgroup.start(command), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, cwd=room,
                                        env=answer_environment(str(room)))
        self.replies = queue.Queue()
        threading.Thread(target=self.read, args=(self.process.stdout, self.replies),
                         daemon=True).start()
        self.errors = []  # the last lines the zygote printed: why it ended, when it does
        threading.Thread(target=self.read, args=(self.process.stderr, self.errors),
                         daemon=True).start()
        atexit.register(self.close, self.process, self.cgroup)

    @staticmethod
    def close(process, cgroup):
        """End a zygote (its stdin closed, it ends after its answer) and remove its cgroup."""
        process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        cgroup.remove()

    def wait(self, timeout):
        """What the watcher said when the answer ended (runner.follow). The watcher stops the answer
        at its limits; past them by a minute, the zygote itself is stopped (and with it, the
        sandbox)."""
        try:
            ended = self.reply(None if timeout is None else timeout + 60)
        except queue.Empty:
            self.process.kill()
            self.process, self.running = None, False
            raise GraderFailed("the grader's watcher of your answer did not stop it after "
                               f"{timeout} s")
        self.running = False
        # (the kernel stopped a process of the answer at the cgroup's memory limit)
        ended["memory"] = self.cgroup.oom_kills() > self.oom_kills
        cpu = self.cgroup.cpu_seconds()
        # the CPU of all its processes, those that no one waited for too (and the watcher's own)
        ended["all_cpu"] = None if cpu is None or self.cpu_before is None else cpu - self.cpu_before
        return ended

    def reply(self, timeout):
        line = self.replies.get(timeout=timeout)
        if line is None:
            said = from_the_answer((self.errors or ["no message"])[-1])
            self.process, self.running = None, False
            raise GraderFailed(f"the process that runs the answers ended ({said}); run the check "
                               "again")
        return json.loads(line)

    @staticmethod
    def read(stream, into):
        for line in stream:
            if isinstance(into, list):
                into[:] = (into + [line.rstrip()])[-20:]
            else:
                into.put(line)
        if not isinstance(into, list):
            into.put(None)


ZYGOTES = {}  # room -> its Zygote
LAUNCHES = itertools.count()  # (each zygote started names its cgroup)


def zygote_of(room):
    if room not in ZYGOTES:
        ZYGOTES[room] = Zygote(room)
    return ZYGOTES[room]
