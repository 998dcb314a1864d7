"""Stack dumps of a running job: each rank writes its pid file, and dumps its threads' stacks on SIGUSR1 when
`python debug.py stacks RUN` asks for them (debug.py reads both). A module of its own, imported where train.py's
`build_run` registers the dump, so that `import train` reads none of it.
"""

import faulthandler
import json
import os
import signal
import socket

STACKS = "stacks"  # <out_dir>/stacks/: each rank's pid file and stack dumps
PROC = "/proc"  # where Linux tells each process's start time (see process_start_time)


def process_start_time(pid):
    """When process `pid` started, in clock ticks after boot (field 22 of /proc/<pid>/stat), or None when
    no such process runs. A pid is reused once its process ends; a (pid, start time) pair is not."""
    try:
        with open(os.path.join(PROC, str(pid), "stat")) as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2, the command name, is in parentheses and may hold spaces and ")": count from the last ")".
    return int(stat.rsplit(")", 1)[1].split()[19])


def register_stack_dump(out_dir, rank):
    """Write this rank's pid, host and start time, and dump its threads' stacks on SIGUSR1. Returns a
    function that undoes both (the pid file must not outlive the process). A no-op where SIGUSR1 does
    not exist (Windows)."""
    if not hasattr(signal, "SIGUSR1"):
        return lambda: None
    folder = os.path.join(out_dir, STACKS)
    os.makedirs(folder, exist_ok=True)
    pid_path = os.path.join(folder, f"rank{rank}.pid")  # the global rank: nodes sharing a folder never collide
    # The start time proves to `debug.py stacks` that the pid is still this rank's: after a kill -9 the
    # file stays behind, and the pid may go to a process that SIGUSR1 would kill (its default action).
    start_time = process_start_time(os.getpid()) if os.path.isdir(PROC) else None
    with open(pid_path, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "rank": rank, "start_time": start_time}, f)
    # Append mode: `debug.py stacks` empties the file before signalling, and the dump lands at its start.
    stacks_file = open(os.path.join(folder, f"rank{rank}.txt"), "a")
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)

    def undo():
        faulthandler.unregister(signal.SIGUSR1)
        stacks_file.close()
        if os.path.exists(pid_path):
            os.remove(pid_path)

    return undo
