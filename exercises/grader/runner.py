"""The process an answer runs in (grading.py starts it; torchrun starts two for the checks of data
parallelism).

    python ROOM/exercises/grader/runner.py ANSWER_FILE MODULE:FUNCTION INPUTS OUTPUTS MARK
    python ROOM/exercises/grader/runner.py --zygote   # one such process per job read from stdin

It runs from the room (room.py: a copy of the project without the teacher's answers), puts the
room's project first on the path (so the answer's `import model` is the room's model.py, whatever
folder the answer file sits in), loads the answer file, calls FUNCTION(answers, inputs), the check's
answer side (a feed_*.py module's), and saves {"outputs": what it returned} as plain data to
OUTPUTS; or, when the answer is not written yet or raised, {"not_done": ...} or {"failed": ...}, one
sentence that names the function and its line. Under torchrun each rank does the same, rank r > 0
into OUTPUTS.r. Right before it loads the answer it prints MARK (a secret of this grading): once
in the pipe the grader reads, no answer can take it back, so a process that ends without it failed
in the grader's own hands (`follow` looks for it), and one that printed it failed in the answer's.

Starting Python and importing torch takes most of 2 s, more than most checks' answers take to run.
So the grader starts one zygote, in the sandbox (sandbox.py): a process that imports torch, the
project and the feed modules once, never loads an answer file, and for each answer forks a watcher
(`watch`), which gives the answer a PID namespace of its own, a folder and a /tmp of bounded size,
forks the answer's process into it, drops its privileges, keeps the end of what it prints, and stops
it at its limits. When the answer's process ends, whatever it left running ends with it."""

import contextlib
import ctypes
import datetime
import importlib
import importlib.util
import json
import os
import resource
import select
import shutil
import signal
import socket
import stat
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# bytes of what the answer prints that the grader gets: the end, where the error is
OUTPUT_TAIL = 16_384
MEMORY = 8 * 2**30  # address space of one answer's process (torch maps most of 1 GB of libraries)
FILE_SIZE = 2**30  # the largest file an answer's process may write
# processes and threads of one answer together, where it has a user of its own (torchrun's two ranks
# and their threads take about 30)
PROCESSES = 64


def load_answers(path):
    """The answer file as a module (its name starts with a digit, so it is loaded by path, not
    imported)."""
    spec = importlib.util.spec_from_file_location(f"exercise_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_line(error):
    # (on new lines only: splitlines would also cut at separators the answer chose, as U+2028)
    text = [line for line in str(error).split("\n") if line.strip()]
    return text[0][:200] if text else ""


def describe_error(path, error):
    """(kind, sentence) for an exception raised while the answer ran: "not_done" for an answer not
    written yet, "failed" for everything else: an error in an answer file (this one, or another
    exercise's it builds on), a file that does not load, or an error the check's answer side ran
    into, fed what the answers returned. Never the grader's: the answer had loaded, and it can
    raise any error from a frame that names any file (compile's filename), so where a frame says
    it ran decides no more than the words of the sentence."""
    path = Path(path).resolve()
    frames = [(frame, line) for frame, line in traceback.walk_tb(error.__traceback__)]
    in_answers = [(frame, line) for frame, line in frames
                  if Path(frame.f_code.co_filename).resolve().parent == path.parent
                  and Path(frame.f_code.co_filename).name[:2].isdigit()]
    if getattr(error, "capstone", False):  # exercise 16's room (room.py) lacks model.py's modules
        return "failed", f"{first_line(error)}."
    if isinstance(error, NotImplementedError) and in_answers:
        frame = in_answers[-1][0]
        where = Path(frame.f_code.co_filename).name
        return "not_done", (f"write {frame.f_code.co_qualname} in exercises/{where} (its docstring "
                            "says what it must "
                            f"do).")
    if ALONE and isinstance(error, BlockingIOError):
        return "failed", (f"your answer tried to start another process or thread "
                          f"({first_line(error)}), which this check refuses: it measures the CPU "
                          "your answer uses, so compute in your own process.")
    if in_answers:
        frame, line = in_answers[-1]
        where = Path(frame.f_code.co_filename).name
        if frame.f_code.co_qualname == "<module>":
            return "failed", (f"exercises/{where} does not load: {type(error).__name__} "
                              f"({first_line(error)}) at "
                              f"line {line}.")
        return "failed", (f"your {frame.f_code.co_qualname} raised {type(error).__name__} "
                          f"({first_line(error)}) at "
                          f"exercises/{where} line {line}.")
    if isinstance(error, SyntaxError) and error.filename and \
            Path(error.filename).name[:2].isdigit():
        return "failed", (f"exercises/{Path(error.filename).name} does not load ({error.msg} at "
                          f"line {error.lineno}).")
    last = traceback.extract_tb(error.__traceback__)[-1:] or [None]
    last = last[0]
    place = f" in {Path(last.filename).name} line {last.lineno}" if last else ""
    return "failed", (f"the check stopped on {type(error).__name__} ({first_line(error)}){place}, "
                      "reached with what "
                      f"your answers in exercises/{path.name} returned.")


# set in the answer's process when it may start no other process or thread (its CPU is measured)
ALONE = []


def run_job(answer_path, side, inputs_path, outputs_path, mark):
    import torch

    from exercises.grader.feeding import ExerciseFailed, plain

    # the checks' models are tiny: a second thread only waits (checking.py)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    if "RANK" in os.environ:
        import torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    inputs = torch.load(inputs_path, weights_only=True)
    module_name, function_name = side.split(":")
    answer_side = getattr(importlib.import_module(module_name), function_name)
    os.write(1, f"\n{mark}\n".encode())
    try:
        came_back = {"outputs": plain(answer_side(load_answers(answer_path), inputs))}
    except ExerciseFailed as failure:  # the answer side found the answer unusable (a wrong type)
        came_back = {"failed": str(failure)}
    except Exception as error:  # noqa: BLE001 - whatever the answer raised, said in one sentence
        kind, sentence = describe_error(answer_path, error)
        came_back = {kind: sentence}
    torch.save(came_back, outputs_path if rank == 0 else f"{outputs_path}.{rank}")
    if "RANK" in os.environ and "outputs" in came_back:
        torch.distributed.destroy_process_group()


# What a zygote imports once, so that its children start with it: the project and every feed module.
PRELOADED = ["torch", "numpy", "regex", "tiktoken", "model", "train", "sample", "data", "optimizer",
             "checkpoint", "hellaswag_eval", "lab.scaling_law", "prepare_data",
             *(f"exercises.grader.{path.stem}"
               for path in sorted((ROOT / "exercises" / "grader").glob("feed*.py")))]


def zygote():
    """Read jobs, one JSON line each ({"job": [ANSWER_FILE, MODULE:FUNCTION, INPUTS, OUTPUTS,
    MARK], "folder": ..., "ranks": 1 or 2, "user": [uid, gid] or null, "counted_as": uid or null
    (runner.count_as), "timeout": s, "cpu": s or
    null, "no_fork": true where the answer may start no process or thread, "room_only": {...} or
    null}), and run each under a watcher (`watch`); with ranks=2 the answer's process becomes
    torchrun, which starts two runners. Write {"pid": the watcher's} when it starts and {"status":
    ..., "limit": ..., "cpu": ..., "loaded": ..., "output": ...} when it ends."""
    # the grader reads replies here; anything else printed goes to stderr
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional package, a module being edited
            pass
    import torch
    torch.set_num_threads(1)
    SANDBOX_TMP.update(os.listdir("/tmp") if os.path.isdir("/tmp") else [])
    for line in sys.stdin:
        request = json.loads(line)
        report, report_to = os.pipe()
        pid = os.fork()
        if pid == 0:  # the watcher: one answer, then gone
            status = 1
            try:
                os.close(report)
                status = watch(request, report_to, [replies.fileno()])
            except BaseException:  # noqa: BLE001 - said where the grader reads it
                traceback.print_exc()
            finally:
                os._exit(status)
        os.close(report_to)
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        with os.fdopen(report, "rb") as f:
            said = f.read()
        _, status = os.waitpid(pid, 0)
        ended = json.loads(said) if said else {"status": os.waitstatus_to_exitcode(status),
                                               "output": "", "limit": None, "cpu": 0.0,
                                               "loaded": False}
        print(json.dumps(ended), file=replies, flush=True)


# Linux's flags (<sched.h>, <sys/mount.h>, <sys/prctl.h>, <linux/capability.h>): Python 3.11's os
# has no unshare.
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x10000000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = \
    0x1, 0x2, 0x4, 0x8, 0x20, 0x1000, 0x2000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = \
    1, 4, 36, 24, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, PR_SET_KEEPCAPS, CAP_SETUID = 47, 4, 8, 7


def watch(request, report, zygote_fds):
    """The watcher of one answer: in a PID namespace of its own where it may make one (as root, or
    in the sandbox), and a mount namespace holding a fresh /tmp and the answer's folder of bounded
    size, it forks the answer's process, whose end ends every process the answer started; it keeps
    the last OUTPUT_TAIL bytes of what they print, stops them past `timeout` seconds or `cpu`
    seconds of CPU (all its processes together), and writes what happened to `report`. Returns its
    exit status."""
    libc = ctypes.CDLL(None, use_errno=True)
    os.setsid()
    alone = libc.unshare(CLONE_NEWPID) == 0
    mounts = own_mount_namespace(libc)
    # (first: the answer's folder is mounted below /tmp)
    fresh = mounts and fresh_tmp(libc, request)
    beneath = own_disk(libc, request) if mounts else None
    # without a namespace, what the answer leaves comes back here
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    output, output_to = os.pipe()
    # (as root: a user namespace the watcher maps for the answer, `no_user_namespaces`)
    mapper, mapped = socket.socketpair() if os.geteuid() == 0 else (None, None)
    pid = os.fork()
    if pid == 0:
        try:
            # should the watcher die, the answer goes too
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            os.close(output)
            if mapper is not None:
                mapper.close()
            # (nor the folder beneath its own, which the watcher holds open)
            held = [report, *zygote_fds] + ([] if beneath is None else [beneath])
            answer_process(request, output_to, held, mapped)
        except BaseException:  # noqa: BLE001 - before the answer ran: the grader's own failure
            traceback.print_exc()
        finally:
            os._exit(1)
    os.close(output_to)
    if mapper is not None:
        mapped.close()
        map_user_namespace(libc, pid, mapper)
    ended = follow(pid, output, request["timeout"], request.get("cpu"), request["job"][4])
    # nothing, in a namespace of its own: its processes ended with the answer's
    stop_descendants(libc)
    if beneath is not None:
        ended["disk_full"] = results_copied_back(request, beneath)
    if fresh:  # (its tmpfs goes with the watcher's mount namespace)
        ended["tmp_full"] = full(b"/tmp")
    else:
        clear_tmp(request)
    os.write(report, json.dumps(ended | {"alone": alone}).encode())
    return 0


def own_mount_namespace(libc):
    """Whether the watcher now has a mount namespace of its own (which the answer's process
    inherits), none of its mounts seen outside: not where none can be made (a plain user without
    bwrap: check.py says so)."""
    return libc.unshare(CLONE_NEWNS) == 0 and \
        libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0


def fresh_tmp(libc, request):
    """Cover /tmp with a new tmpfs of request["tmp_bytes"], in the watcher's mount namespace,
    holding only the entries of the old /tmp on the way to request["tmp_kept"] (the room, the
    answers' folders, Python where they lie there), bound back: nothing an earlier answer left there
    is seen, nor, without the sandbox, anything else of the machine's /tmp; what this answer writes
    there takes at most that size, and goes with the namespace. Returns whether it was made."""
    size = request.get("tmp_bytes")
    if size is None:
        return False
    kept = {Path(path).relative_to("/tmp").parts[0]
            for given in request.get("tmp_kept", []) for path in (given, os.path.realpath(given))
            if Path(path).is_relative_to("/tmp") and Path(path) != Path("/tmp")}
    old = os.open("/tmp", os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", MS_NOSUID | MS_NODEV,
                      f"size={size},mode=1777".encode()) != 0:
            return False
        for name in sorted(kept):
            source, target = f"/proc/self/fd/{old}/{name}", f"/tmp/{name}"
            if os.path.islink(source):
                os.symlink(os.readlink(source), target)
                continue
            if os.path.isdir(source):
                os.mkdir(target)
            else:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            if libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None) != 0:
                raise OSError(ctypes.get_errno(), f"/tmp/{name} could not be kept in the /tmp of "
                                                  "the answer")
    finally:
        os.close(old)
    return True


def full(path):
    """Whether the file system of `path` has less than 1 MB left (what was written stopped at its
    size)."""
    space = os.statvfs(path)
    return space.f_bavail * space.f_frsize < 2**20


def own_disk(libc, request):
    """Give the answer a folder of at most request["folder_bytes"] in all: in the watcher's mount
    namespace, a tmpfs of that size over the answer's folder, holding copies of what the grader put
    there, and the folder of all the answers' folders read-only around it, so that what the answer
    writes takes the machine's memory up to that size, never its disk. Returns a descriptor of the
    folder beneath, to copy the answer's results back to."""
    folder, user, size = request["folder"], request.get("user"), request.get("folder_bytes")
    if size is None:
        return None
    beneath = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    # (no one but this watcher may read the descriptor through /proc)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    around = os.path.dirname(folder).encode()
    options = f"size={size},mode=0700" + (f",uid={user[0]},gid={user[1]}" if user else "")
    if libc.mount(around, around, None, MS_BIND | MS_REC, None) != 0 or \
            libc.mount(None, around, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
                       None) != 0 or \
            libc.mount(b"tmpfs", folder.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                       options.encode()) != 0:
        raise OSError(ctypes.get_errno(), "the answer's folder could not be made")
    shutil.copytree(f"/proc/self/fd/{beneath}", folder, symlinks=True, dirs_exist_ok=True)
    if user is not None:
        for path in [Path(folder), *Path(folder).rglob("*")]:
            os.chown(path, *user, follow_symlinks=False)
    return beneath


def results_copied_back(request, beneath):
    """Copy the answer's results (OUTPUTS, and OUTPUTS.r of rank r) from its folder to the folder
    beneath (`beneath`, a descriptor), where the grader reads them: plain files only, no link
    followed. Returns whether the answer's folder was full (what it wrote stopped at its size)."""
    folder, name = request["folder"], os.path.basename(request["job"][3])
    filled = full(folder)
    no_follow = os.O_NOFOLLOW | os.O_NONBLOCK
    for entry in os.listdir(folder):
        if entry != name and not entry.startswith(name + "."):
            continue
        with contextlib.suppress(OSError):
            source = os.open(os.path.join(folder, entry), os.O_RDONLY | no_follow)
            with os.fdopen(source, "rb") as read:
                if not stat.S_ISREG(os.fstat(source).st_mode):
                    continue
                target = os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL | no_follow, 0o644,
                                 dir_fd=beneath)
                with os.fdopen(target, "wb") as write:
                    shutil.copyfileobj(read, write)
    os.close(beneath)
    return filled


# The entries of /tmp when the zygote started: in the sandbox, what bwrap made (the folders on the
# way to the room, the answers' folders and Python where they lie under /tmp).
SANDBOX_TMP = set()


def clear_tmp(request):
    """Where the answer got no fresh /tmp (no mount namespace: `fresh_tmp`), remove what it left in
    /tmp, its processes all ended, so that the next answer finds /tmp as the sandbox made it, its
    space free again: in the sandbox, every entry that was not there when the zygote started; on the
    machine's own /tmp (no sandbox), every entry of the answer's own user, where it has one. As that
    user where it has one (the watcher ends right after), so that what it made closed to others
    still goes."""
    user = request.get("user")
    if request.get("room_only") and user is None:
        return  # (the machine's /tmp, shared with the grader's user: none tells the answer's apart)
    if user is not None:
        os.setgroups([])
        os.setgid(user[1])
        os.setuid(user[0])
    for entry in os.scandir("/tmp"):
        try:
            owner = entry.stat(follow_symlinks=False).st_uid
        except OSError:
            continue
        if (not request.get("room_only") and entry.name in SANDBOX_TMP) or \
                (user is not None and owner != user[0]):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, onerror=opened_and_removed)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


def opened_and_removed(function, path, _):
    """shutil.rmtree's second try at `path`, which the answer closed to its own user (chmod 000)."""
    for folder in (os.path.dirname(path), path):
        with contextlib.suppress(OSError):
            if folder != "/tmp" and not os.path.islink(folder):  # (/tmp itself stays as it is)
                os.chmod(folder, 0o700)
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            function(path)


def answer_process(request, output, close, mapped=None):
    """Become the answer's process: output to the watcher, no stdin, nothing of the zygote's open,
    limits, no user namespace of its own (`mapped`: as root, its end of the watcher's socket that
    maps one), no privileges, then the job (or torchrun, which starts one runner per rank)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    for fd in [devnull, output, *close]:
        os.close(fd)
    os.chdir(request["folder"])
    if request.get("room_only"):
        isolate(**request["room_only"])
    limits = ((resource.RLIMIT_AS, MEMORY), (resource.RLIMIT_FSIZE, FILE_SIZE),
              (resource.RLIMIT_CORE, 0))
    if request.get("no_fork"):
        # The CPU a check measures is counted by process, and a child that ends unwaited-for
        # (SIGCHLD ignored) takes its CPU with it: so no second process or thread at all. The limit
        # counts the processes of the answer's user: this one alone, where it has a user of its own.
        limits += ((resource.RLIMIT_NPROC, 1),)
        ALONE.append(True)
    elif request.get("user") is not None or request.get("counted_as") is not None:
        # all the answer's processes and threads together (its user's: this answer's alone)
        limits += ((resource.RLIMIT_NPROC, PROCESSES),)
    for limit, value in limits:
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))  # (hard too: the answer cannot raise it again)
    if mapped is not None:
        no_user_namespaces(mapped)
    drop_privileges(request.get("user"), request.get("counted_as"))
    # (the watcher is not, so that the folder beneath the answer's stays out of reach through /proc)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    for name in set(os.environ) - set(request["environment"]):  # (bwrap's PWD, ...)
        del os.environ[name]
    os.environ.update(request["environment"], HOME=request["folder"])
    if request.get("ranks", 1) > 1:
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={request['ranks']}", __file__,
                                  *request["job"]])
    run_job(*request["job"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def no_user_namespaces(mapped):
    """Make no more user namespaces possible for the answer's processes (one is a way to
    capabilities, and to the kernel's less tried code): as root, where bwrap --disable-userns would
    need a user namespace of the sandbox's that also holds the answers' user ids, the answer's
    process makes its own, which the watcher maps to the same users (`map_user_namespace`, over
    `mapped`), and, root there, sets the number of user namespaces inside it to 0 before it drops
    its privileges."""
    libc = ctypes.CDLL(None, use_errno=True)
    with mapped:
        if libc.unshare(CLONE_NEWUSER) != 0:
            return  # (where root makes none, neither does the answer's user)
        mapped.sendall(b"made")
        if mapped.recv(6) != b"mapped":
            raise OSError("the watcher did not map the answer's user namespace")
        Path("/proc/sys/user/max_user_namespaces").write_text("0")
        mapped.sendall(b"set")
        mapped.recv(6)  # (/proc/sys read-only again)


def map_user_namespace(libc, pid, mapper):
    """The watcher's side of no_user_namespaces: map the user namespace of the answer's process
    `pid` to the same users and groups, and make /proc/sys (read-only in bwrap) writable while the
    answer's process, still the grader's code, writes its number of user namespaces there."""
    mapper.settimeout(60)
    with mapper:
        if mapper.recv(4) != b"made":
            return
        for name in ("uid_map", "gid_map"):
            Path(f"/proc/{pid}/{name}").write_text("0 0 4294967295")
        opened = libc.mount(None, b"/proc/sys", None, MS_BIND | MS_REMOUNT, None) == 0
        mapper.sendall(b"mapped")
        mapper.recv(3)
        if opened:
            libc.mount(None, b"/proc/sys", None,
                       MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        mapper.sendall(b"closed")


def drop_privileges(user, counted_as=None):
    """Become `user` (uid, gid) where given (the grader is root), which takes every capability with
    it; else keep the grader's user and shed the capabilities the sandbox gave the watcher, its
    processes counted as user id `counted_as` where given (`count_as`). No exec regains any."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if user is not None:
        os.setgroups([])
        os.setgid(user[1])
        os.setuid(user[0])
        return
    for capability in range(64):
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if counted_as is not None:
        count_as(libc, counted_as)
    set_capabilities(libc, 0)


def set_capabilities(libc, effective):
    """Keep exactly the capabilities of the mask `effective` (bits of <linux/capability.h>'s
    numbers below 32), permitted and in effect; none inheritable."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Sets(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    sets = (Sets * 2)()  # _LINUX_CAPABILITY_VERSION_3: the low 32 capabilities, then the high
    sets[0].effective = sets[0].permitted = effective
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), sets) != 0:
        raise OSError(ctypes.get_errno(), "the answer's process could not set its capabilities")


def count_as(libc, uid):
    """As root without privileges (the grader's user, where Python is closed to other users), take
    `uid` as the real, effective and saved user id and keep root as the file system user id alone:
    the kernel then counts the answer's processes and threads as that user's, so RLIMIT_NPROC binds
    them (it never binds root's), while files are read and written as today, as root without
    privileges (the owner's rights of root's files). An exec sets the file system user id back to
    the effective one, so torchrun's ranks, which exec, are never started this way."""
    libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)  # (CAP_SETUID kept across setresuid, for setfsuid)
    os.setresuid(uid, uid, uid)
    set_capabilities(libc, 1 << CAP_SETUID)
    libc.setfsuid(0)
    if libc.setfsuid(-1) != 0:  # (an id that is no one's changes nothing, and says the current)
        raise OSError("the answer's process could not keep root's file system user id")


def follow(pid, output, timeout, cpu_limit, mark):
    """Wait for the answer's process `pid`, reading its output: {"status": its exit status or None,
    "limit": "time" or "cpu" when it was stopped at one, "cpu": seconds of CPU of all its processes,
    "loaded": whether `mark` came (run_job prints it right before it loads the answer), "output":
    the end of what they printed, without the mark}."""
    tail, status, limit, cpu, ended_at, reading = bytearray(), None, None, 0.0, None, True
    mark, loaded = f"\n{mark}\n".encode(), False
    deadline = time.monotonic() + timeout
    while True:
        if not reading:
            time.sleep(0.1)
        elif select.select([output], [], [], 0.1)[0]:
            data = os.read(output, 65536)
            reading = bool(data)
            tail += data
            if not loaded and mark in tail:
                loaded = True
                del tail[tail.index(mark):tail.index(mark) + len(mark)]
            # (kept a mark long, so a mark cut in two by the pipe is found once whole)
            del tail[:-max(OUTPUT_TAIL, len(mark))]
        if status is None:
            done, code, usage = os.wait4(pid, os.WNOHANG)
            if done:
                status, ended_at = os.waitstatus_to_exitcode(code), time.monotonic()
                cpu = max(cpu, usage.ru_utime + usage.ru_stime)
                continue
            cpu = max(cpu, cpu_of_descendants())
            over = ("time" if time.monotonic() > deadline
                    else "cpu" if cpu_limit and cpu > cpu_limit else None)
            if over:
                limit = over
                # in its namespace, the rest goes with it (else stop_descendants)
                os.kill(pid, signal.SIGKILL)
        elif not reading or time.monotonic() - ended_at > 1:  # (a leftover may hold the output)
            break
    os.close(output)
    return {"status": status, "limit": limit, "cpu": cpu, "loaded": loaded,
            "output": tail.decode(errors="replace")}


def processes():
    """{pid: (parent pid, seconds of CPU: its own and its waited-for children's)} of this machine's
    (or this sandbox's) processes, from /proc."""
    ticks, found = os.sysconf("SC_CLK_TCK"), {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or one that ended meanwhile
        found[int(name)] = (int(fields[1]), sum(int(v) for v in fields[11:15]) / ticks)
    return found


def descendants(table, root):
    children = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def cpu_of_descendants():
    """Seconds of CPU of every process below this one, the ended ones counted by whoever waited for
    them."""
    table = processes()
    return sum(table[pid][1] for pid in descendants(table, os.getpid()))


def stop_descendants(libc):
    """Stop every process still below this one (this watcher is their subreaper): frozen first, so
    that a chain of forks cannot outrun the killing, then killed."""
    for _ in range(1000):
        below = descendants(processes(), os.getpid())
        if not below:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in below:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def isolate(hidden, python):
    """Without the sandbox, shut the answer's process in as far as the platform allows (room.py
    lists what holds where): as root, in a mount namespace of its own, open the folders above
    `python` to the answer alone and cover each folder of `hidden` (the teacher's project) with an
    empty unreadable one. The user is dropped after (drop_privileges)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0 or \
            libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return
    reach_python(libc, [Path(p) for p in python])
    for path in hidden:
        libc.mount(b"tmpfs", str(path).encode(), b"tmpfs",
                   MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, b"size=4k,mode=000")


def reach_python(libc, folders):
    """Let the unprivileged user reach Python's folders (a venv's and its interpreter's) where a
    folder above them is closed to others (Python installed in root's home, mode 700): in this
    namespace, cover each highest closed folder with an empty one open to all and put the Python
    folders under it back. What else it held stays out of reach."""
    closed = {}
    for folder in folders:
        for path in {folder, folder.resolve()}:
            top = next((p for p in reversed(path.parents)
                        if p != Path("/") and not os.stat(p).st_mode & 0o001), None)
            if top is not None:
                closed.setdefault(top, []).append(path)
    count = 0
    for top, inside in closed.items():
        staged = []
        for path in inside:
            stage, count = Path(os.getcwd()) / f".python-{count}", count + 1
            stage.mkdir()
            bound = libc.mount(str(path).encode(), str(stage).encode(), None, MS_BIND | MS_REC,
                               None)
            if bound == 0:
                staged.append((stage, path))
        covered = libc.mount(b"tmpfs", str(top).encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                             b"size=64k,mode=755")
        if covered != 0:
            continue
        for stage, path in staged:
            path.mkdir(parents=True, exist_ok=True)
            libc.mount(str(stage).encode(), str(path).encode(), None, MS_MOVE, None)


if __name__ == "__main__":
    zygote() if sys.argv[1:] == ["--zygote"] else run_job(*sys.argv[1:])
