"""warm_python.py, which most of the suite's `python ...` runs go through, behaves as `python` does; the
suite's helpers leave the system temp folder as they found it."""

import os
import subprocess
import sys

import warm_python
from conftest import ROOT


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


def test_the_suites_helpers_leave_the_system_temp_folder_as_they_found_it(tmp_path):
    """tests/conftest.py's folders in the system temp folder (the bucket cache, the small task sets),
    pytest's own (tmp_path) and what a test or a program it starts writes there are gone when the
    session ends, with pytest-xdist's workers as without."""
    (tmp_path / "test_helpers.py").write_text(
        "import subprocess, sys, tempfile\nfrom conftest import tiny_task_data\n\n\n"
        "def test_task_data(tmp_path):\n    assert tiny_task_data() and tmp_path.is_dir()\n\n\n"
        "def test_a_program_writes_in_the_temp_folder():\n    tempfile.mkdtemp()\n"
        "    subprocess.run([sys.executable, '-c', 'import tempfile; tempfile.mkstemp()'], check=True)\n")
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {name: value for name, value in os.environ.items()
           if name not in ("NANOGPT_REMOTE_CACHE", "NANOGPT_TEST_TEMP", "PYTEST_XDIST_WORKER")}
    env.update(TMPDIR=str(temp), PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")]))
    for workers in ("0", "2"):
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                                 "-n", workers, f"--rootdir={tmp_path}", "test_helpers.py"], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert list(temp.iterdir()) == [], workers
