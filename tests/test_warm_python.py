"""warm_python.py, which most of the suite's `python ...` runs go through, behaves as `python` does."""

import os

import warm_python


def test_a_warm_child_is_a_process_of_its_own_that_exits_as_python_does(tmp_path):
    (tmp_path / "model.py").write_text("WHERE = 'the fork'\n")
    (tmp_path / "main.py").write_text("import atexit, os, sys, model\natexit.register(print, 'atexit ran')\n"
                                      "print(os.getpid(), sys.argv, model.WHERE, os.environ['SEEN'])\nsys.exit(3)\n")
    result = warm_python.python(["main.py", "--a=1"], tmp_path, {**os.environ, "SEEN": "yes"})
    pid, rest = result.stdout.split(" ", 1)
    assert result.returncode == 3 and int(pid) != os.getpid()
    assert rest == "['main.py', '--a=1'] the fork yes\natexit ran\n"  # its own folder's modules, not the project's
    said = warm_python.python(["-c", "import sys; print(sys.argv); sys.exit('one sentence')", "x"], tmp_path)
    assert (said.returncode, said.stdout, said.stderr) == (1, "['-c', 'x']\n", "one sentence\n")
    failed = warm_python.python(["-c", "raise ValueError('no')"], tmp_path)
    assert failed.returncode == 1 and failed.stderr.endswith("ValueError: no\n")
