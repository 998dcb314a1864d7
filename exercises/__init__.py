"""Classroom exercises that check themselves (docs/exercises.md).

Each `NN_name.py` holds the answer functions of one exercise; `check.py` compares them with the
project's own code (`python exercises/check.py N`); the grader behind it lives in `grader/`, with
the teacher's `grader/make_student_copy.py`, which copies the project with those functions blanked
out. `answers_of` lets one answer file build on another's (the capstone, 16, assembles GPT-2 from
exercise 10's parts).
"""

import importlib.util
from pathlib import Path


def answers_of(number, beside):
    """Exercise `number`'s answer file in the folder of `beside` (an answer file's __file__), loaded as a module:
    the answers next to yours, whichever copy of the project they sit in."""
    folder = Path(beside).resolve().parent
    path = next(folder.glob(f"{number:02d}_*.py"), None)
    if path is None:
        raise FileNotFoundError(f"no exercise {number} beside {Path(beside).name}: an answer builds only on the "
                                f"course's answer files")
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
