"""The process an answer runs in (grading.py starts it; torchrun starts two for the checks of data parallelism).

    python ROOM/exercises/grader/runner.py ANSWER_FILE MODULE:FUNCTION INPUTS OUTPUTS
    python ROOM/exercises/grader/runner.py --zygote   # forks one such process per job read from stdin (grading.py)

It runs from the room (room.py: a copy of the project without the teacher's answers), puts the room's project
first on the path (so the answer's `import model` is the room's model.py, whatever folder the answer file sits
in), shuts itself in (`isolate`: on Linux as root, the teacher's tree hidden and the user dropped to nobody),
loads the answer file, calls FUNCTION(answers, inputs), the check's answer side (a feed_*.py module's), and saves
{"outputs": what it returned} as plain data to OUTPUTS; or, when the answer is not written yet or raised,
{"not_done": ...} or {"failed": ...}, one sentence that names the function and its line. Under torchrun each rank
does the same, rank r > 0 into OUTPUTS.r.

Starting Python and importing torch takes most of 2 s, more than most checks' answers take to run. So a
grader with many answers to run (`check.py all`, the tests) starts one zygote: a process that imports torch,
the project and the feed modules once, never loads an answer file, and forks a fresh child for each answer. The
child is a process of its own like any other: what the answer patches dies with it.
"""

import datetime
import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def load_answers(path):
    """The answer file as a module (its name starts with a digit, so it is loaded by path, not imported)."""
    spec = importlib.util.spec_from_file_location(f"exercise_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_line(error):
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


def describe_error(path, error):
    """(kind, sentence) for an exception raised while the answer ran: "not_done" for an answer not written yet,
    "failed" for an error in an answer file (this one, or another exercise's it builds on), a file that does not
    load, or an error the check's answer side ran into, fed what the answers returned."""
    path = Path(path).resolve()
    frames = [(frame, line) for frame, line in traceback.walk_tb(error.__traceback__)]
    in_answers = [(frame, line) for frame, line in frames
                  if Path(frame.f_code.co_filename).resolve().parent == path.parent
                  and Path(frame.f_code.co_filename).name[:2].isdigit()]
    if isinstance(error, NotImplementedError) and in_answers:
        frame = in_answers[-1][0]
        where = Path(frame.f_code.co_filename).name
        return "not_done", (f"write {frame.f_code.co_qualname} in exercises/{where} (its docstring says what it must "
                            f"do).")
    if in_answers:
        frame, line = in_answers[-1]
        where = Path(frame.f_code.co_filename).name
        if frame.f_code.co_qualname == "<module>":
            return "failed", (f"exercises/{where} does not load: {type(error).__name__} ({first_line(error)}) at "
                              f"line {line}.")
        return "failed", (f"your {frame.f_code.co_qualname} raised {type(error).__name__} ({first_line(error)}) at "
                          f"exercises/{where} line {line}.")
    if isinstance(error, SyntaxError) and error.filename and Path(error.filename).name[:2].isdigit():
        return "failed", f"exercises/{Path(error.filename).name} does not load ({error.msg} at line {error.lineno})."
    last = traceback.extract_tb(error.__traceback__)[-1:] or [None]
    last = last[0]
    if isinstance(error, AssertionError) and last and Path(last.filename).resolve().parent == ROOT / "exercises" / "grader":
        return "failed", (f"this exercise cannot be checked: the project no longer does what it teaches "
                          f"({first_line(error)}); tell your teacher.")
    place = f" in {Path(last.filename).name} line {last.lineno}" if last else ""
    return "failed", (f"the check stopped on {type(error).__name__} ({first_line(error)}){place}, reached with what "
                      f"your answers in exercises/{path.name} returned.")


# Linux's mount(2) and unshare(2) flags (<sys/mount.h>, <sched.h>): Python 3.11's os has no unshare.
CLONE_NEWNS, MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = \
    0x20000, 0x1, 0x2, 0x4, 0x8, 0x1000, 0x2000, 0x4000, 0x40000


def isolate(hidden, user):
    """Shut this process in before the answer loads, as far as the platform allows (room.py lists what holds
    where): with `user` (uid, gid; given when the grader is root on Linux), in a mount namespace of this
    process's own, cover each folder of `hidden` (the teacher's project) with an empty unreadable one, then
    become `user`, who can write neither the room nor the teacher's tree. Returns the folders it could not hide
    (then the user is dropped all the same)."""
    if user is None:
        return list(hidden)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    alone = libc.unshare(CLONE_NEWNS) == 0 and libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0
    if alone:
        reach_python(libc, Path(sys.prefix))
    missed = [path for path in hidden if not alone or libc.mount(
        b"tmpfs", str(path).encode(), b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k,mode=000")]
    os.setgroups([])
    os.setgid(user[1])
    os.setuid(user[0])
    return missed


def reach_python(libc, prefix):
    """Let the unprivileged user reach Python's own folder where a folder above it is closed to others (Python
    installed in root's home, mode 700): in this namespace, cover the highest closed folder with an empty one
    open to all and put `prefix` back inside it. What else that folder held stays out of reach."""
    closed = next((p for p in reversed(prefix.parents) if p != Path("/") and not os.stat(p).st_mode & 0o001), None)
    if closed is None:
        return
    stage = Path(os.getcwd()) / ".python"
    stage.mkdir()
    if libc.mount(str(prefix).encode(), str(stage).encode(), None, MS_BIND | MS_REC, None) == 0 and libc.mount(
            b"tmpfs", str(closed).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=64k,mode=755") == 0:
        prefix.mkdir(parents=True)
        libc.mount(str(stage).encode(), str(prefix).encode(), None, MS_MOVE, None)


def run_job(answer_path, side, inputs_path, outputs_path):
    import torch

    from exercises.grader.feeding import ExerciseFailed, plain

    torch.set_num_threads(1)  # the checks' models are tiny: a second thread only waits (checking.py)
    rank = int(os.environ.get("RANK", "0"))
    if "RANK" in os.environ:
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    inputs = torch.load(inputs_path, weights_only=True)
    module_name, function_name = side.split(":")
    answer_side = getattr(importlib.import_module(module_name), function_name)
    try:
        came_back = {"outputs": plain(answer_side(load_answers(answer_path), inputs))}
    except ExerciseFailed as failure:  # the answer side found the answer unusable (a wrong type, ...)
        came_back = {"failed": str(failure)}
    except Exception as error:  # noqa: BLE001 - whatever the answer raised, said in one sentence
        kind, sentence = describe_error(answer_path, error)
        came_back = {kind: sentence}
    torch.save(came_back, outputs_path if rank == 0 else f"{outputs_path}.{rank}")
    if "RANK" in os.environ and "outputs" in came_back:
        torch.distributed.destroy_process_group()


# What a zygote imports once, so that its children start with it: the project and every feed module.
PRELOADED = ["torch", "numpy", "regex", "tiktoken", "model", "train", "sample", "data", "optimizer", "checkpoint",
             "hellaswag_eval", "scaling_law", "prepare_data",
             *(f"exercises.grader.{path.stem}" for path in sorted((ROOT / "exercises" / "grader").glob("feed*.py")))]


def zygote():
    """Read jobs, one JSON line each ({"job": [ANSWER_FILE, MODULE:FUNCTION, INPUTS, OUTPUTS], "folder": ...,
    "ranks": 1 or 2, "hidden": [...], "user": [uid, gid] or null}), and run each in a forked child, in `folder`,
    shut in (`isolate`), its output in folder/output.txt; with ranks=2 the child becomes torchrun, which starts
    two such runners. Write {"pid": ...} when the child starts (the leader of a process group: stopping it stops
    torchrun's ranks too) and {"status": its exit status} when it ends."""
    replies = os.fdopen(os.dup(1), "w")  # the grader reads replies here; anything else printed goes to stderr
    os.dup2(2, 1)
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional package, a module being edited: the child says what fails
            pass
    import torch
    torch.set_num_threads(1)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: one answer, then gone
            status = 1
            try:
                replies.close()
                os.setsid()
                os.chdir(request["folder"])
                output = os.open(os.path.join(request["folder"], "output.txt"), os.O_WRONLY | os.O_CREAT)
                os.dup2(output, 1)
                os.dup2(output, 2)
                sys.stdin.close()
                isolate(request.get("hidden", []), request.get("user"))
                os.environ["HOME"] = request["folder"]
                if request.get("ranks", 1) > 1:
                    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                              f"--nproc-per-node={request['ranks']}", __file__, *request["job"]])
                run_job(*request["job"])
                status = 0
            except BaseException:  # noqa: BLE001 - said where the grader reads it, as a process would say it
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


if __name__ == "__main__":
    zygote() if sys.argv[1:] == ["--zygote"] else run_job(*sys.argv[1:])
