"""`python SCRIPT ARGS` (or `python -c CODE ARGS`) in a process of its own, started warm: forked from a process that
has already imported torch. On this project's 2-core machines a new Python spends about 4 of a tiny run's 6 seconds
importing torch and torch._dynamo (which the first optimizer imports), so the suite's many short runs go about twice
as fast this way.

The child is a real process: its own pid, environment, working folder, signals, exit status, stdout and stderr, and
a fresh copy of the project's modules, read from its own folder (a fork of the project runs its own model.py). What
differs from `python SCRIPT` is only that torch, numpy and tiktoken are already imported, with one thread per
process as OMP_NUM_THREADS=1 gives. Tests of what a new interpreter does (signals, kill -9, torchrun) use real
processes.

    python tests/warm_python.py --serve   # the server: reads one request per line, forks a child for each
"""

import atexit
import importlib
import json
import os
import queue
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback

PRELOADED = ["torch", "torch._dynamo", "numpy", "tiktoken", "tiktoken.load", "regex"]


def serve():
    """Read requests ({"args", "cwd", "env", "stdout", "stderr"}), one JSON line each; fork a child for each, and
    write {"pid": ...} when it starts and {"status": ...} when it ends."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for name in PRELOADED:
        importlib.import_module(name)
    sys.modules["torch"].set_num_threads(1)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            replies.close()
            run_child(request)  # never returns: the child exits as python would
        print(json.dumps({"pid": pid}), file=replies, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)


def run_child(request):
    """Become `python ARGS` in request["cwd"] with request["env"], its output in the request's two files."""
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(0, closefd=False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    args = request["args"]
    code = 0
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]  # as python -c: the code is not in argv
            sys.path[0] = ""
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            script = os.path.abspath(args[0])
            sys.argv = [args[0], *args[1:]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(args[0], run_name="__main__")  # argv[0] as given, as python sets it
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # noqa: BLE001 - as python reports it: the traceback, and exit status 1
        traceback.print_exc()
        code = 1
    # As Python exits: the threads joined, the atexit handlers run, the streams flushed. Then out at once: tearing
    # down torch's modules as an interpreter's end does takes a second and a half, and changes nothing seen.
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


class WarmPython:
    """The server, started at the first call and kept for this process (a pytest worker); one child at a time."""

    def __init__(self):
        self.process, self.replies = None, None

    def run(self, args, cwd, env, timeout):
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, cwd=tempfile.gettempdir(),
                                            env={**os.environ, "OMP_NUM_THREADS": "1"})
            self.replies = queue.Queue()
            threading.Thread(target=self.read, args=(self.process.stdout, self.replies), daemon=True).start()
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            self.process.stdin.write(json.dumps({"args": [str(a) for a in args], "cwd": str(cwd), "env": env,
                                                 "stdout": out, "stderr": err}) + "\n")
            self.process.stdin.flush()
            pid = self.reply(None)["pid"]
            try:
                code = self.reply(timeout)["status"]
            except queue.Empty:
                os.kill(pid, 9)
                self.reply(None)
                raise subprocess.TimeoutExpired(args, timeout)
            with open(out) as o, open(err) as e:
                return subprocess.CompletedProcess(args, code, o.read(), e.read())

    def reply(self, timeout):
        line = self.replies.get(timeout=timeout)
        if line is None:
            self.process = None
            raise RuntimeError("the warm Python server ended")
        return json.loads(line)

    @staticmethod
    def read(stdout, replies):
        for line in stdout:
            replies.put(line)
        replies.put(None)


SERVER = WarmPython()


def python(args, cwd, env=None, timeout=600):
    """`python ARGS` in `cwd` with `env` (os.environ's by default), run as a warm child; a CompletedProcess with
    text stdout and stderr, like subprocess.run(..., capture_output=True, text=True)."""
    return SERVER.run(list(args), cwd, dict(os.environ if env is None else env), timeout)


if __name__ == "__main__":
    serve()
