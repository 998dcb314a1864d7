"""The walls of the sandbox an answer runs in (exercises/grader/sandbox.py, runner.py): the
project's answers pass wherever Python lives; an answer sees no other checkout and no variable of
the grader's; what it leaves running ends with its grading; what it prints reaches the grader as a
short tail, its control characters escaped; a failure the grader causes is said as the grader's; and
without bubblewrap the grading says so in one line and still passes the project's answers."""

import ast
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT
from test_exercises import answer_folder

import exercises.grader.grading as grading
import exercises.grader.sandbox as sandbox
from exercises.check import grade
from exercises.grader.checking import ExerciseFailed, GraderFailed
from exercises.grader.grading import Answers
from exercises.grader.sandbox import Cgroup, Sandbox

CHECK = ROOT / "exercises" / "check.py"
AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
# The exercises whose answers import a module of Python's own, or start torchrun, only once they
# run.
LAZY = [4, 5, 6, 15, 16, 20, 21]


@pytest.fixture(params=["bwrap", "room alone"])
def walls(request, monkeypatch):
    """Grading in the bubblewrap sandbox (skipped where it cannot start), or in the room alone: a
    Sandbox and zygotes of the test's own, stopped after it."""
    box = Sandbox(use_bwrap=request.param == "bwrap")
    if request.param == "bwrap" and box.bwrap is None:
        pytest.skip(f"bubblewrap cannot start here ({box.reason})")
    zygotes = {}
    monkeypatch.setattr(grading, "SANDBOX", [box])
    monkeypatch.setattr(grading, "ZYGOTES", zygotes)
    yield request.param
    for zygote in zygotes.values():
        if zygote.process is not None:
            zygote.process.kill()
            zygote.process.wait()


def python_only_root_can_read(tmp_path):
    """A venv whose own folder and whose interpreter's both lie in a folder only root may enter (as
    pyenv puts Python under root's home, mode 700): its interpreter is this one's, reached through a
    link in that folder, and a .pth file gives it this interpreter's site-packages (torch, ...)."""
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o700)
    base, venv = private / "base", private / "venv"
    base.symlink_to(Path(sys.base_prefix).resolve())
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    packages = venv / "lib" / version / "site-packages"
    packages.mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "bin" / "python").symlink_to(base / "bin" / version)
    (venv / "pyvenv.cfg").write_text(f"home = {base / 'bin'}\ninclude-system-site-packages = false"
                                     f"\nversion = {sys.version.split()[0]}\n")
    (packages / "lab.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv / "bin" / "python"


@pytest.mark.skipif(not AS_ROOT, reason="answers run as users of their own only under root")
@pytest.mark.parametrize("walls,numbers", [("bwrap", LAZY), ("--no-bwrap", [4, 15])],
                         ids=["bwrap", "room alone"])
def test_as_root_with_python_in_a_folder_only_root_can_read_the_projects_answers_pass(
        tmp_path, data_root, walls, numbers):
    """check.py as a teacher runs it, as root, its Python under a folder closed to other users: the
    exercises whose answers import what Python's own library holds only as they run, or start
    torchrun, pass, and the grading says in one line that the folder is opened to the answers alone.
    """
    if not (Path(sys.base_prefix).resolve() / "bin").is_dir():
        pytest.skip("this Python has no bin/ under its prefix to make a venv from")
    python = python_only_root_can_read(tmp_path)
    command = [str(python), str(CHECK), *map(str, numbers), f"--data_root={data_root}"]
    command += ["--no-bwrap"] if walls == "--no-bwrap" else []
    graded = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = graded.stdout.splitlines()
    assert graded.returncode == 0 and [line.split(" passed: ")[0] for line in lines] == \
        [f"exercise {n}" for n in numbers], graded.stdout + graded.stderr
    said = graded.stderr.splitlines()
    assert len(said) == 1 and f"{tmp_path / 'private'}" in said[0], graded.stderr
    assert "opened to" in said[0], graded.stderr



NOBODY = 65534  # the unprivileged user of most Linux systems


def python_closed_to_others(tmp_path):
    """python_only_root_can_read's venv, its own folder closed too (an install made with umask 077)."""
    if not (Path(sys.base_prefix).resolve() / "bin").is_dir():
        pytest.skip("this Python has no bin/ under its prefix to make a venv from")
    python = python_only_root_can_read(tmp_path)
    (tmp_path / "private" / "venv").chmod(0o700)
    return python


@pytest.mark.skipif(not AS_ROOT, reason="answers run as root without its privileges only under root")
def test_as_root_with_pythons_own_folder_closed_to_others_the_answers_run_counted_as_users_and_pass(
        tmp_path, data_root):
    """In bubblewrap the answers run as root without its privileges, their processes counted as a
    user of their own (runner.count_as), and pass, exercise 21 (no second process) and torchrun's 15
    included."""
    if Sandbox().bwrap is None:
        pytest.skip("bubblewrap cannot start here")
    numbers = [4, 15, 21]
    command = [str(python_closed_to_others(tmp_path)), str(CHECK), *map(str, numbers),
               f"--data_root={data_root}"]
    graded = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = graded.stdout.splitlines()
    assert graded.returncode == 0 and [line.split(" passed: ")[0] for line in lines] == \
        [f"exercise {n}" for n in numbers], graded.stdout + graded.stderr
    assert "the answers run as root without its privileges" in graded.stderr, graded.stderr


@pytest.mark.skipif(not AS_ROOT, reason="answers run as root without its privileges only under root")
def test_as_root_without_bubblewrap_and_pythons_own_folder_closed_the_grading_is_refused(tmp_path):
    """Without the sandbox's read-only system, root's owner rights would reach root's files (and
    sysctls, and sockets) across the machine: one sentence, nothing graded."""
    python = python_closed_to_others(tmp_path)
    graded = subprocess.run([str(python), str(CHECK), "14", "--no-bwrap"], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    said = graded.stderr.splitlines()
    assert graded.returncode == 1 and graded.stdout == "", graded.stdout + graded.stderr
    assert said[-1].startswith("error: as root without bubblewrap the answers would run as root") and \
        f"{tmp_path / 'private' / 'venv'} (Python) is closed to other users" in said[-1], graded.stderr


def closed_ancestor(path):
    """The outermost folder above `path` that other users cannot enter (root's home), or None."""
    for folder in reversed(Path(path).parents):
        if folder != Path("/") and not os.stat(folder).st_mode & 0o001:
            return folder
    return None


@pytest.mark.skipif(not AS_ROOT or not shutil.which("unshare") or not shutil.which("setpriv"),
                    reason="a user without privileges is made from root, with unshare and setpriv")
def test_as_a_user_without_privileges_the_answers_run_in_bubblewrap_and_pass(data_root):
    """check.py as a student runs it on a laptop: not root, with Python where every user may read it. Made
    here from root: in a mount namespace of its own, the folder that closes Python to others (root's home) is
    covered by an open one holding the same Python at the same paths, and check.py runs as `nobody`. The
    answers run in bubblewrap (no line saying otherwise) and torchrun's two ranks meet on its loopback."""
    from exercises.grader.sandbox import bwrap_binary, python_folders

    if bwrap_binary() is None:
        pytest.skip("no bwrap here")
    shared = Path(tempfile.mkdtemp(prefix="graded-as-nobody-"))  # not under pytest's folder, closed to others
    try:
        shared.chmod(0o755)
        project, data = shared / "project", shared / "data"
        shutil.copytree(ROOT, project, ignore=shutil.ignore_patterns(".git", "tests", "docs", "data", "out",
                                                                     "__pycache__", ".bench", "*.png"))
        shutil.copytree(data_root, data)
        subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(project), str(data)], check=True)
        script = ["set -e"]
        folders = python_folders()
        closed = {closed_ancestor(folder) for folder in folders} - {None}
        for i, folder in enumerate(folders):  # held under /tmp while the closed folder is covered
            script += [f"mkdir -p {shared}/python{i}", f"mount --bind {folder} {shared}/python{i}"]
        script += [f"mount -t tmpfs -o mode=755 none {folder}" for folder in closed]
        for i, folder in enumerate(folders):
            script += [f"mkdir -p {folder}", f"mount --bind {shared}/python{i} {folder}"]
        script += [f"cd {project}", f"exec setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups env "
                   f"HOME={project} {sys.executable} exercises/check.py 15 --data_root={data}"]
        graded = subprocess.run(["unshare", "-m", "bash", "-c", "\n".join(script)], capture_output=True,
                                text=True, timeout=600)
        if "unshare" in graded.stderr and graded.returncode != 0 and "exercise" not in graded.stdout:
            pytest.skip(f"no mount namespace here: {graded.stderr.strip()[:200]}")
        assert graded.returncode == 0 and graded.stdout.startswith("exercise 15 passed: torchrun ran 2 gloo"), \
            graded.stdout + graded.stderr
        assert graded.stderr == "", graded.stderr  # bwrap, and nothing to say about it
    finally:
        shutil.rmtree(shared, ignore_errors=True)

# An answer to exercise 14 that looks for what it should not see: the grader's variables, the
# teacher's tree, another checkout readable by every user, and any exercises/ folder in the usual
# top folders.
LOOKING_ANSWER = """
import os as _os


def rank_sequences(position, rank, world_size, batch_size):
    found = []
    for top in ("/work", "/home", "/srv", "/opt", "/mnt", "/tmp", "/root", {other!r}):
        for folder, subfolders, files in _os.walk(top):
            if folder.count("/") > 5:
                subfolders[:] = []
            if "10_gpt.py" in files or "checks_step.py" in files:
                found.append(folder)
    raise ValueError("env " + repr(sorted(_os.environ)) + " found " + repr(sorted(found)))
"""


def test_an_answer_sees_no_other_checkout_and_no_variable_it_was_not_given(tmp_path, walls,
                                                                           monkeypatch):
    other = Path(tempfile.mkdtemp())  # another checkout, readable by every user
    try:
        other.chmod(0o755)
        shutil.copytree(ROOT / "exercises", other / "exercises")
        for folder in [other, *(p for p in other.rglob("*") if p.is_dir())]:
            folder.chmod(0o755)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "the-grader's-secret")
        folder = answer_folder(tmp_path, 14, code=LOOKING_ANSWER.format(other=str(other)))
        passed, line = grade(14, folder)
    finally:
        shutil.rmtree(other)
    assert not passed and " found " in line, line
    variables = ast.literal_eval(line.split("(env ")[1].split(" found ")[0])
    assert set(variables) <= {"PATH", "HOME", "OMP_NUM_THREADS", "LANG"}, line
    if walls == "bwrap":
        # not the teacher's tree, not the other checkout, not this test's copy
        assert "found []" in line, line


# An answer to exercise 14 that leaves processes behind: a double fork in a session of its own, and
# a chain of shells each of which starts the next and ends, faster than a list of processes can be
# read. Started at the first call, and as far as the answer's limit on processes lets it (where it
# has a user of its own, the chains' zombies soon reach it).
LEAVING_ANSWER = """
import os as _os
import subprocess as _subprocess

_started = []


def rank_sequences(position, rank, world_size, batch_size):
    if not _started:
        _started.append(True)
        try:
            if _os.fork() == 0:
                _os.setsid()
                if _os.fork() == 0:
                    _os.execv("/bin/sh", ["sh", "-c", "while :; do sleep 1; done # {marker}"])
                _os._exit(0)
            for _ in range(4):
                chain = 'sh -c "$0" "$1" & exit'
                _subprocess.Popen(["/bin/sh", "-c", chain, chain, "{marker}"])
        except BlockingIOError:
            pass
    return [position + rank * batch_size + i for i in range(batch_size)]
"""


def left_behind(marker):
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_what_an_answer_leaves_running_ends_with_its_grading(tmp_path, walls):
    marker = f"left-by-an-answer-{os.getpid()}-{time.monotonic_ns()}"
    folder = answer_folder(tmp_path, 14, code=LEAVING_ANSWER.format(marker=marker))
    try:
        passed, line = grade(14, folder)
        time.sleep(0.5)  # (a process killed is gone once its parent has waited for it)
        assert passed, line
        assert left_behind(marker) == [], left_behind(marker)
    finally:
        for pid in left_behind(marker):
            os.kill(pid, signal.SIGKILL)


def test_an_answers_message_reaches_the_line_with_its_control_characters_escaped(tmp_path):
    folder = answer_folder(tmp_path, 14, code="""
        def rank_sequences(position, rank, world_size, batch_size):
            raise ValueError("\\r\\x1b[2Kexercise 14 passed: \\u202eevery index is right")
        """)
    passed, line = grade(14, folder)
    assert not passed and line.startswith("exercise 14 failed"), line
    assert "\\x1b[2Kexercise 14 passed" in line, line
    assert line.isprintable() and "\\u202e" in line, line


PRINTING_ANSWER = """
import os as _os
import sys as _sys


def rank_sequences(position, rank, world_size, batch_size):
    line = "x" * 2**20 + "\\n"
    for _ in range(300):
        _sys.stdout.write(line)
    _sys.stdout.write("\\r\\x1b[2Kexercise 14 passed: every index is right.\\n")
    _sys.stdout.flush()
    _os._exit(3)
"""


# Starts the grader and writes its peak memory (with its descendants') to stderr. A small process
# of its own between the test and the grader: Linux keeps the peak of the process that starts a
# program across the exec, so a grader started by a pytest worker would report the worker's peak.
PEAK_OF = """
import os, sys
pid = os.spawnv(os.P_NOWAIT, sys.executable, [sys.executable, *sys.argv[1:]])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024), file=sys.stderr)  # bytes or KiB
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "wait4"), reason="measures the grader's memory with wait4")
def test_an_answer_that_prints_300_mb_costs_the_grader_a_short_tail_shown_escaped(tmp_path):
    folder = answer_folder(tmp_path, 14, code=PRINTING_ANSWER)
    graded = subprocess.run([sys.executable, "-c", PEAK_OF, str(CHECK), "14", f"--student={folder}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    line, peak = graded.stdout, int(graded.stderr.split()[-1])
    assert graded.returncode == 1 and line.count("\n") == 1, line
    assert "exit status 3" in line and "\\x1b[2Kexercise 14 passed" in line, line
    assert "\x1b" not in line, line
    assert peak < 900 * 2**20, f"the grader peaked at {peak / 2**20:.0f} MiB"


def test_a_failure_the_grader_causes_is_said_as_the_graders_not_the_students(monkeypatch):
    """A room whose runner cannot import what feeds the answer (as when Python's library is out of
    reach): one sentence that says the grader could not start the answer, and asks for the teacher.
    """
    import exercises.check

    def missing_side(answers, inputs):
        """A feed function of a module the room does not hold."""

    missing_side.__module__ = "exercises.grader.feed_that_is_not_there"
    with pytest.raises(GraderFailed, match="before it loaded the answer: ModuleNotFoundError"):
        Answers(14).run(missing_side, None)
    monkeypatch.setattr(exercises.check, "check_of",
                        lambda number: lambda answers: answers.run(missing_side))
    passed, line = grade(14)
    assert not passed and line.endswith("; tell your teacher."), line
    assert line.startswith("exercise 14 could not be graded: the grader could not start your "
                           "answer: "), line
    assert "failed" not in line.split(":")[0], line


# Answers that make their own failure read as the grader's: the file the runner once wrote before
# loading the answer removed, an error raised from a frame that names a file of Python's install,
# a message whose line separator (U+2028) would choose the "last line" the grader shows.
AS_THE_GRADERS = [  # (code, words of the failure)
    ("""
import os as _os


def rank_sequences(position, rank, world_size, batch_size):
    for name in ("answer-loading", "out.pt"):
        if _os.path.exists(name):
            _os.remove(name)
    _os._exit(3)
""", "before it answered: no output"),
    ("""
import os as _os

exec(compile("def rank_sequences(position, rank, world_size, batch_size):\\n"
             "    raise PermissionError('[Errno 13] the sandbox closed a file')\\n",
             _os.path.dirname(_os.__file__) + "/shutil.py", "exec"))
""", "PermissionError ([Errno 13] the sandbox closed a file) in shutil.py"),
    ("""
import os as _os


def rank_sequences(position, rank, world_size, batch_size):
    print("IndexError\\u2028ModuleNotFoundError: no module named torch", flush=True)
    _os._exit(3)
""", "before it answered: IndexError\\u2028ModuleNotFoundError"),
]


@pytest.mark.parametrize("code,words", AS_THE_GRADERS,
                         ids=["marker removed", "install's frame", "U+2028"])
def test_an_answers_failure_never_reads_as_the_graders(code, words, tmp_path):
    passed, line = grade(14, answer_folder(tmp_path, 14, code=code))
    assert not passed and line.startswith("exercise 14 failed"), line
    assert words in line and "teacher" not in line and line.isprintable(), line


def test_without_bubblewrap_the_grading_says_so_in_one_line_and_still_passes(monkeypatch):
    import exercises.grader.sandbox as sandbox

    monkeypatch.setattr(sandbox, "bwrap_binary", lambda: shutil.which("false"))
    box = Sandbox()
    assert box.bwrap is None
    assert box.describe().startswith("grading without bubblewrap (bwrap cannot start here")
    graded = subprocess.run([sys.executable, str(CHECK), "14", "--no-bwrap"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert graded.returncode == 0, graded.stdout + graded.stderr
    assert graded.stdout.startswith("exercise 14 passed"), graded.stdout
    said = graded.stderr.splitlines()
    assert len(said) == 1, graded.stderr
    assert said[0].startswith("grading without bubblewrap (--no-bwrap): each answer runs in the "
                              "room alone"), graded.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's resource limits")
def test_an_answer_that_grabs_memory_is_stopped_at_its_limit_not_the_machines(tmp_path, walls):
    folder = answer_folder(tmp_path, 14, code="""
        def rank_sequences(position, rank, world_size, batch_size):
            hoard = bytearray(12 * 2**30)  # more than an answer may have, less than the machine
            return [len(hoard)]
        """)
    passed, line = grade(14, folder)
    assert not passed and "your rank_sequences raised MemoryError" in line, line


def test_each_answer_finds_tmp_as_the_sandbox_made_it(tmp_path, walls):
    """What one answer leaves in /tmp is gone before the next runs (as root without bubblewrap: what
    the answer's own user left in the machine's /tmp)."""
    if walls == "room alone" and not AS_ROOT:
        pytest.skip("on the machine's /tmp only an answer's own user tells its files apart")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    leaving = answer_folder(tmp_path / "a", 14, code="""
        def rank_sequences(position, rank, world_size, batch_size):
            import os
            os.makedirs("/tmp/left-by-an-earlier-answer/closed")
            os.chmod("/tmp/left-by-an-earlier-answer", 0)
            raise ValueError("left a folder in /tmp")
        """)
    finding = answer_folder(tmp_path / "b", 14, code="""
        _right = rank_sequences


        def rank_sequences(position, rank, world_size, batch_size):
            import os
            if os.path.lexists("/tmp/left-by-an-earlier-answer"):
                raise ValueError("found what an earlier answer left in /tmp")
            return _right(position, rank, world_size, batch_size)
        """)
    assert "left a folder in /tmp" in grade(14, leaving)[1]
    passed, line = grade(14, finding)
    assert passed, line


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mount namespaces")
def test_an_answer_that_fills_tmp_is_stopped_at_its_own_tmps_size_and_leaves_nothing_there(
        tmp_path, walls, monkeypatch):
    """Three files of 30 MB each against a /tmp of 64 MB here (2 GB when check.py grades), a tmpfs
    of the answer's own: without bubblewrap, never the machine's /tmp."""
    if walls == "room alone" and not AS_ROOT:
        pytest.skip("a plain user without bubblewrap makes no mount namespace: check.py says so")
    monkeypatch.setattr(grading, "TMP_BYTES", 64 * 2**20)
    name = f"filled-by-an-answer-{os.getpid()}"
    folder = answer_folder(tmp_path, 14, code=f"""
        def rank_sequences(position, rank, world_size, batch_size):
            for part in "abc":
                with open("/tmp/{name}-" + part, "wb") as f:
                    f.write(b"x" * 30 * 2**20)
            raise ValueError("wrote 90 MB in /tmp")
        """)
    passed, line = grade(14, folder)
    assert not passed and "your answer filled /tmp, 64 MB" in line, line
    assert not list(Path("/tmp").glob(f"{name}-*"))


@pytest.mark.skipif(not AS_ROOT, reason="a plain user without bubblewrap makes no mount namespace")
def test_an_answer_finds_nothing_of_the_machines_tmp_in_its_own(tmp_path, walls):
    """Its /tmp holds the room, the answers' folders and Python where they lie there, nothing else
    of the machine's."""
    with tempfile.NamedTemporaryFile(dir="/tmp", prefix="the-machines-own-") as machines:
        folder = answer_folder(tmp_path, 14, code=f"""
            def rank_sequences(position, rank, world_size, batch_size):
                import os
                if os.path.lexists({machines.name!r}):
                    raise ValueError("found a file of the machine's /tmp")
                raise ValueError("/tmp holds " + str(len(os.listdir("/tmp"))) + " entries")
            """)
        passed, line = grade(14, folder)
    assert not passed and "/tmp holds" in line, line


def test_in_its_fresh_tmp_an_answer_still_writes_neither_the_room_nor_beside_its_folder(tmp_path, walls):
    if walls == "room alone" and not AS_ROOT:
        pytest.skip("a plain user without bubblewrap writes what the grader's user writes")
    folder = answer_folder(tmp_path, 14, code="""
        def rank_sequences(position, rank, world_size, batch_size):
            import os
            import model
            written = []
            for path in (model.__file__, os.path.join(os.path.dirname(os.getcwd()), "beside")):
                try:
                    with open(path, "a") as f:
                        f.write("# written by an answer")
                    written.append(path)
                except OSError:
                    pass
            raise ValueError("wrote " + (", ".join(written) or "nothing"))
        """)
    passed, line = grade(14, folder)
    assert not passed and "(wrote nothing)" in line, line


# An answer to exercise 14 that starts 200 processes, each sleeping a minute, before answering.
HUNDREDS_OF_PROCESSES = """
        _right = rank_sequences


        def rank_sequences(position, rank, world_size, batch_size):
            import os
            import time
            for _ in range(200):
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
            return _right(position, rank, world_size, batch_size)
        """


@pytest.mark.skipif(not AS_ROOT, reason="an answer's processes are counted by its own user, under root")
def test_an_answer_that_starts_hundreds_of_processes_is_stopped_at_its_limit(tmp_path, walls):
    folder = answer_folder(tmp_path, 14, code=HUNDREDS_OF_PROCESSES)
    passed, line = grade(14, folder)
    assert not passed and "your rank_sequences raised BlockingIOError" in line, line


@pytest.fixture
def as_root_without_a_cgroup(tmp_path, walls, monkeypatch):
    """The answers run as root without its privileges (as where Python's own folder is closed to
    other users), and no cgroup holds them."""
    if not AS_ROOT:
        pytest.skip("answers run as root without privileges only under root")
    monkeypatch.setattr(grading.SANDBOX[0], "as_grader", Path(sys.prefix))
    monkeypatch.setattr(grading, "Cgroup", lambda name: Cgroup(name, root=tmp_path / "no-cgroups"))


def test_as_root_without_privileges_and_no_cgroup_an_answers_processes_stop_at_its_limit(
        tmp_path, as_root_without_a_cgroup):
    folder = answer_folder(tmp_path, 14, code=HUNDREDS_OF_PROCESSES)
    passed, line = grade(14, folder)
    assert not passed and "your rank_sequences raised BlockingIOError" in line, line


def test_as_root_without_privileges_and_no_cgroup_a_check_that_measures_cpu_refuses_a_second_process(
        tmp_path, as_root_without_a_cgroup):
    from exercises.grader.feed_core import ranks_answers

    folder = answer_folder(tmp_path, 14, code="""
        _right = rank_sequences


        def rank_sequences(position, rank, world_size, batch_size):
            import os
            import signal
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
            if os.fork() == 0:
                os._exit(0)
            return _right(position, rank, world_size, batch_size)
        """)
    with pytest.raises(ExerciseFailed, match="your answer tried to start another process or thread"):
        Answers(14, folder).run(ranks_answers, [(0, 0, 1, 2)], cpu=10.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's mount namespaces")
def test_an_answer_that_fills_its_folder_is_stopped_at_the_folders_size_not_the_disks(
        tmp_path, walls, monkeypatch):
    """Three files of 30 MB each, each within the 1 GB a file may take, against a folder of 64 MB
    here (1 GB when check.py grades); the folder beneath, where the grader reads the results, out of
    its reach."""
    if walls == "room alone" and not AS_ROOT:
        pytest.skip("a plain user without bubblewrap makes no mount namespace: check.py says so")
    monkeypatch.setattr(grading, "FOLDER_BYTES", 64 * 2**20)
    folder = answer_folder(tmp_path, 14, code="""
        _right = rank_sequences


        def rank_sequences(position, rank, world_size, batch_size):
            import os
            for fd in os.listdir("/proc/self/fd"):  # the folder beneath its own, held open?
                path = f"/proc/self/fd/{fd}"
                if os.path.isdir(path) and os.stat(path).st_dev != os.stat(".").st_dev \
                        and os.path.exists(f"{path}/in.pt"):
                    raise ValueError("reached the folder beneath its own")
            for name in "abc":
                with open(name, "wb") as f:
                    f.write(b"x" * 30 * 2**20)
            return _right(position, rank, world_size, batch_size)
        """)
    passed, line = grade(14, folder)
    assert not passed and "your answer filled its folder, 64 MB in all" in line, line


@pytest.mark.skipif(not AS_ROOT, reason="as a plain user, bwrap --disable-userns holds this (not run here)")
def test_an_answer_makes_no_user_namespace_of_its_own(tmp_path, walls):
    folder = answer_folder(tmp_path, 14, code="""
        def rank_sequences(position, rank, world_size, batch_size):
            import ctypes
            import os
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER
                raise ValueError("made a user namespace")
            raise ValueError("no user namespace: " + os.strerror(ctypes.get_errno()))
        """)
    passed, line = grade(14, folder)
    assert not passed and "no user namespace: No space left on device" in line, line


def test_a_plain_user_without_bubblewrap_hears_that_the_answers_folder_is_not_size_limited(monkeypatch):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    line = Sandbox(use_bwrap=False).describe()
    assert "nothing limits the disk an answer's folder takes but 1 GB a file" in line, line


def cgroup_here(limiting=None):
    """Whether the grader may make a cgroup on this machine (root, a writable hierarchy); with
    `limiting`, one that has a limit of that controller ("memory")."""
    probe = Cgroup(f"exercise-probe-{os.getpid()}")
    probe.remove()
    if limiting is not None:
        return any(name.startswith(f"{limiting}.") for name in probe.limits)
    return bool(probe.folders)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not cgroup_here("memory"),
                    reason="the answer's memory is counted as a whole in a cgroup, where one may be made")
def test_an_answer_whose_processes_together_take_too_much_memory_is_stopped(tmp_path, walls,
                                                                             monkeypatch):
    """Three processes of 1 GB each, each within its own limit, against a whole of 2 GB here."""
    monkeypatch.setattr(sandbox, "CGROUP_MEMORY", 2 * 2**30)
    monkeypatch.setattr(grading, "CGROUP_MEMORY", 2 * 2**30)
    folder = answer_folder(tmp_path, 14, code="""
        _right = rank_sequences


        def rank_sequences(position, rank, world_size, batch_size):
            import os
            import time
            for _ in range(2):
                if os.fork() == 0:
                    hoard = b"x" * 2**30
                    time.sleep(5)
                    os._exit(len(hoard) and 0)
            hoard = b"x" * 2**30
            time.sleep(5)
            return _right(position, rank, world_size, batch_size)[:len(hoard)]
        """)
    passed, line = grade(14, folder)
    assert not passed and "your answer's processes together used more than 2 GB" in line, line


@pytest.mark.skipif(not sys.platform.startswith("linux") or not cgroup_here(),
                    reason="the CPU of an answer's every process is counted in a cgroup, where one may be made")
def test_the_cpu_of_children_nobody_waits_for_counts_where_a_cgroup_holds_the_answer(
        tmp_path, walls, monkeypatch):
    """With a second process allowed (the refusal of one is exercise 21's first wall), the CPU of
    short children reaped unwaited-for (SIGCHLD ignored) still counts against the answer's limit."""
    from exercises.grader.grading import OverCpu, Zygote

    start = Zygote.start
    monkeypatch.setattr(Zygote, "start", lambda self, request: start(self, {**request, "no_fork": False}))
    folder = answer_folder(tmp_path, 14, code="""
        _right = rank_sequences


        def rank_sequences(position, rank, world_size, batch_size):
            import os
            import signal
            import time
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)
            for _ in range(30):
                if os.fork() == 0:
                    until = time.process_time() + 0.05
                    while time.process_time() < until:
                        pass
                    os._exit(0)
                time.sleep(0.06)
            return _right(position, rank, world_size, batch_size)
        """)
    from exercises.grader.feed_core import ranks_answers
    with pytest.raises(OverCpu):  # 1.5 s of CPU in children, one case: the answer itself takes little
        Answers(14, folder).run(ranks_answers, [(0, 0, 1, 2)], cpu=1.0)


def version_2_root():
    """Where cgroup version 2's one hierarchy is mounted: alone at /sys/fs/cgroup, or beside version
    1's controllers (a hybrid machine) at /sys/fs/cgroup/unified; None where it is not."""
    return next((root for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
                 if (root / "cgroup.subtree_control").exists()), None)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not AS_ROOT,
                    reason="a cgroup is made by root on Linux")
def test_a_version_2_cgroup_holds_what_it_starts_counts_its_cpu_limits_what_is_enabled_and_goes():
    root = version_2_root()
    if root is None:
        pytest.skip("no cgroup version 2 hierarchy is mounted here")
    name = f"exercise-version-2-{os.getpid()}"
    cgroup = Cgroup(name, root=root)
    if not cgroup.folders:
        pytest.skip(f"this process may make no cgroup below its own in {root}")
    folder = cgroup.folders[0]
    try:
        burn = ("import time\nuntil = time.process_time() + 0.3\nwhile time.process_time() < until: pass\n"
                "print(open('/proc/self/cgroup').read())")
        ran = subprocess.run(cgroup.start([sys.executable, "-c", burn]), capture_output=True, text=True,
                             timeout=60)
        assert ran.returncode == 0, ran.stderr
        assert any(line.startswith("0::/") and line.endswith(f"/{name}") for line in ran.stdout.splitlines()), \
            ran.stdout
        assert cgroup.cpu_seconds() >= 0.3
        enabled = (folder.parent / "cgroup.subtree_control").read_text().split()
        for controller, limits in sandbox.CGROUP2_LIMITS.items():
            for limit, value in limits.items():
                if controller in enabled and (folder / limit).exists():
                    assert cgroup.limits[limit] == value and int((folder / limit).read_text()) == value
                else:
                    assert limit not in cgroup.limits
    finally:
        cgroup.remove()
    assert not folder.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's cgroups")
def test_a_version_2_cgroup_gets_the_limits_its_parent_enables_and_reads_its_cpu_and_oom_kills(
        tmp_path, monkeypatch):
    """A version 2 tree of files: the parent enables memory, not pids."""
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    (tmp_path / "cgroup").write_text("0::/grading\n")
    monkeypatch.setattr(sandbox, "PROC_CGROUP", str(tmp_path / "cgroup"))
    root = tmp_path / "unified"
    (root / "grading").mkdir(parents=True)
    (root / "grading" / "cgroup.subtree_control").write_text("cpu memory\n")
    cgroup = Cgroup("answers", root=root)
    folder = root / "grading" / "answers"
    assert cgroup.folders == [folder]
    # (no memory.swap.max in this tree: a kernel without swap accounting)
    assert cgroup.limits == {"memory.max": sandbox.CGROUP_MEMORY}, cgroup.limits
    assert (folder / "memory.max").read_text() == str(sandbox.CGROUP_MEMORY) and not (folder / "pids.max").exists()
    (folder / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cgroup.cpu_seconds() == 1.5 and cgroup.oom_kills() == 1
    assert str(folder / "cgroup.procs") in cgroup.start(["python"])[2]
