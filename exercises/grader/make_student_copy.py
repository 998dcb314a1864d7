"""Make a student's copy of the project, with the exercises' answers blanked out.

    python exercises/grader/make_student_copy.py DEST

DEST (a new or empty folder) gets the project's files: those git tracks or would track, so no
prepared data, runs or caches (the copy prepares its data on first use, as the project does). In
every exercises/NN_name.py, the body of each answer function, and of each method of an answer class,
becomes `raise NotImplementedError("exercise N: ...")`; its signature and docstring (what it must do)
stay. The project's answers are copied nowhere (no solutions/ folder): an answer running in the copy, or
a student, would find them; `check.py N --hint=3 --against=TEACHER` prints the code from the teacher's copy.
A folder named solutions/ in the project is left out too. tests/test_exercises*.py are left out: they
check that the project's own answers pass, which a student's copy is not meant to do yet. The project
itself is only read.

In DEST, `python train.py` trains as in the project, and `python exercises/check.py N` says "not done
yet" in one sentence until the student writes exercise N.
"""

import ast
import fnmatch
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from config import UserError, run_command  # noqa: E402 - needs the line above

STUDENT_COPY = "STUDENT_COPY"  # the file in exercises/ that marks a student's copy
# Tests the answers pass; old copies' answers; the mark of a copy made from a copy.
NOT_COPIED = ("tests/test_exercise*.py", "exercises/solutions/*", f"exercises/{STUDENT_COPY}")
# Without git (a project unpacked from an archive): every file except these folders.
SKIPPED_FOLDERS = {".git", "__pycache__", ".pytest_cache", "data", "out", "wandb"}


def project_files(root):
    """The project's files, relative to `root`: what git tracks or would track (not what it ignores)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                                capture_output=True, check=True).stdout.decode().split("\0")
        names = [name for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        names = [str(path.relative_to(root)) for path in root.rglob("*")
                 if path.is_file() and not SKIPPED_FOLDERS & set(path.relative_to(root).parts)]
    return sorted({name for name in names if (root / name).is_file()
                   and not any(fnmatch.fnmatch(name, pattern) for pattern in NOT_COPIED)})


def blank_answers(source, number):
    """`source` of an answer file with the body of each top-level function, and of each method of a top-level
    class, replaced by a NotImplementedError (its signature and docstring kept), the rest unchanged."""
    lines = source.splitlines(keepends=True)
    functions = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            functions.append((node, node.name))
        elif isinstance(node, ast.ClassDef):
            functions += [(m, f"{node.name}.{m.name}") for m in node.body if isinstance(m, ast.FunctionDef)]
    for node, name in sorted(functions, key=lambda pair: -pair[0].lineno):  # bottom up: the lines above stay
        first = node.body[0]
        has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str)
        keep = first.end_lineno if has_docstring else first.lineno - 1  # lines kept: up to the docstring's end
        indent = " " * first.col_offset
        message = f"exercise {number}: write {name} (its docstring says what it must do)"
        lines[keep:node.end_lineno] = [f"{indent}raise NotImplementedError({message!r})\n"]
    return "".join(lines)


def make_student_copy(dest, root=ROOT):
    """Copy the project at `root` into `dest` with the answers blanked; returns the files blanked."""
    dest = Path(dest).resolve()
    if dest == root or root in dest.parents:
        raise UserError(f"{dest} is inside the project; give a folder outside {root}.")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"{dest} already exists and is not an empty folder; give a new folder.")
    blanked = []
    for name in project_files(root):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        path = Path(name)
        number = path.name.split("_", 1)[0]
        if path.parent == Path("exercises") and path.suffix == ".py" and number.isdigit():
            target.write_text(blank_answers((root / name).read_text(), int(number)))
            blanked.append(name)
        else:
            shutil.copy2(root / name, target)
    # What says this is a student's copy once every answer in it is written: its answer files are the student's,
    # never a reference (hints.py's level 3 then asks the teacher's copy).
    (dest / "exercises" / STUDENT_COPY).write_text(
        "A student's copy, made by exercises/grader/make_student_copy.py: its answer files are the "
        "student's.\n")
    return blanked


def main(argv):
    if len(argv) != 1 or argv[0].startswith("-"):
        raise UserError("give one argument, the folder to create: python exercises/grader/make_student_copy.py DEST.")
    blanked = make_student_copy(argv[0])
    print(f"student copy in {os.path.abspath(argv[0])}: the answers of {len(blanked)} exercises blanked out.")
    print(f"next: cd {argv[0]} && python exercises/check.py 1")


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
