"""Check your answer to a classroom exercise against the project's own code (docs/exercises.md).

    python exercises/check.py 3                   # exercise 3: "passed" and exit status 0, or what differs and 1
    python exercises/check.py all                 # every exercise, in order, one line each
    python exercises/check.py 5 --data_root=DIR   # where the prepared Shakespeare data lives (default: data/)
    python exercises/check.py 3 --hint            # the first hint; --hint=2 the next one, and so on
    python exercises/check.py 3 --against=TEACHER # graded by the teacher's untouched copy of the project

Your answers are the functions in exercises/NN_name.py (NN is the exercise's number). The check loads
that file, runs its functions beside the project's code (checks_step.py for exercises 1-5,
checks_run.py for 6-9) and prints one line. An answer
not written yet, or one that raises an error, is reported in one sentence naming the function.
"""

import argparse
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the project's modules (train, model, ...), from any working directory

from exercises.checking import ExerciseFailed  # noqa: E402 - needs the line above
from exercises.checks_core import check_adamw, check_bpe, check_clipping, check_ranks, check_ddp  # noqa: E402
from exercises.checks_model import check_gpt  # noqa: E402
from exercises.checks_run import check_optimizer, check_resume, check_scaling_law, check_task  # noqa: E402
from exercises.checks_step import (check_accumulation, check_attention, check_metric, check_mfu,  # noqa: E402
                                   check_schedule)

# The exercises in order: number -> its check. Exercise N's answers are in exercises/NN_*.py.
CHECKS = {1: check_schedule, 2: check_accumulation, 3: check_attention, 4: check_mfu, 5: check_metric,
          6: check_resume, 7: check_task, 8: check_scaling_law, 9: check_optimizer, 10: check_gpt, 11: check_bpe,
          12: check_adamw, 13: check_clipping, 14: check_ranks, 15: check_ddp}
ANSWERS = HERE  # where the answer files are read from (--answers_from: the student's, graded by this copy)


def answer_file(number):
    """exercises/NN_name.py for exercise `number`."""
    return next(ANSWERS.glob(f"{number:02d}_*.py"))


def load_answers(path):
    """The answer file as a module (its name starts with a digit, so it is loaded by path, not imported)."""
    spec = importlib.util.spec_from_file_location(f"exercise_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_line(error):
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


def describe_error(number, path, error):
    """One sentence for an exception that is not a failed comparison: an answer not written yet, an error
    in the answer file, or an error the check ran into elsewhere (the project's code, fed a wrong answer)."""
    frames = traceback.extract_tb(error.__traceback__)
    in_answers = [frame for frame in frames if Path(frame.filename).resolve() == path]
    where = f"exercises/{path.name}"
    if isinstance(error, NotImplementedError) and in_answers:
        return (f"exercise {number} is not done yet: write {in_answers[-1].name} in {where} (its docstring says what "
                f"it must do).")
    if in_answers:
        frame = in_answers[-1]
        return (f"exercise {number} failed: your {frame.name} raised {type(error).__name__} ({first_line(error)}) at "
                f"{where} line {frame.lineno}.")
    if isinstance(error, SyntaxError) and error.filename and Path(error.filename).resolve() == path:
        return f"exercise {number} failed: {where} does not load ({error.msg} at line {error.lineno})."
    last = frames[-1] if frames else None
    if isinstance(error, AssertionError) and last and Path(last.filename).resolve().parent == HERE:
        return (f"exercise {number} cannot be checked: the project no longer does what the exercise teaches "
                f"({first_line(error)}); tell your teacher.")
    place = f" in {Path(last.filename).name} line {last.lineno}" if last else ""
    return (f"exercise {number} failed: the check stopped on {type(error).__name__} ({first_line(error)}){place}, "
            f"reached with what your answers in {where} returned.")


def run_check(number, data_root=""):
    """(passed, the line to print) for exercise `number`."""
    path = answer_file(number).resolve()
    check = CHECKS[number]
    options = {"data_root": data_root} if "data_root" in inspect.signature(check).parameters else {}
    try:
        # exercise 15's check runs the answer file itself, in two processes
        summary = check(path) if number == 15 else check(load_answers(path), **options)
    except ExerciseFailed as failure:
        return False, f"exercise {number} failed: {failure}"
    except Exception as error:  # noqa: BLE001 - whatever the student's code raised, said in one sentence
        return False, describe_error(number, path, error)
    return True, f"exercise {number} passed: {summary}"


def main(argv):
    parser = argparse.ArgumentParser(description="Check a classroom exercise against the project's own code.")
    parser.add_argument("exercise", choices=[str(n) for n in CHECKS] + ["all"], help="the exercise's number, or all")
    parser.add_argument("--data_root", default="",
                        help="the folder holding shakespeare/ (default: the project's data/)")
    parser.add_argument("--hint", type=int, nargs="?", const=1, default=0,
                        help="print hint number HINT (1 = the first) instead of checking")
    parser.add_argument("--against", default="",
                        help="a teacher's untouched copy of the project: its code and checks grade your answers")
    parser.add_argument("--answers_from", default="", help=argparse.SUPPRESS)  # (what --against passes on)
    args = parser.parse_args(argv)
    if args.hint:
        if args.exercise == "all":
            print("error: --hint takes one exercise's number, e.g. check.py 3 --hint.", file=sys.stderr)
            return 1
        return print_hint(int(args.exercise), args.hint)
    if args.against:
        return grade_against(args)
    if args.answers_from:
        global ANSWERS
        ANSWERS = Path(args.answers_from).resolve()
    if args.data_root and not os.path.isdir(args.data_root):  # before anything is prepared or written there
        print(f"error: --data_root={args.data_root} is not a folder; give the folder that holds shakespeare/ "
              f"(or leave it out to use the project's data/).", file=sys.stderr)
        return 1
    numbers = list(CHECKS) if args.exercise == "all" else [int(args.exercise)]
    torch.set_num_threads(1)  # the checks' models are tiny: a second thread only waits (see checking.py)
    results = []
    for number in numbers:
        passed, line = run_check(number, args.data_root)
        print(line, flush=True)
        results.append(passed)
    return 0 if all(results) else 1


def print_hint(number, level):
    """Hint `level` of exercise `number` (its answer file's HINTS): where to look first, then how."""
    hints = getattr(load_answers(answer_file(number).resolve()), "HINTS", [])
    if not 1 <= level <= len(hints):
        print(f"exercise {number} has {len(hints)} hint(s); ask for 1 to {len(hints)}.", file=sys.stderr)
        return 1
    more = f" (more: --hint={level + 1})" if level < len(hints) else " (the last one)"
    print(f"exercise {number}, hint {level} of {len(hints)}{more}: {hints[level - 1]}")
    return 0


def grade_against(args):
    """Run the teacher's copy's check.py on this copy's answers: the project code the check compares with,
    and the check itself, come from the teacher's copy, so editing either here changes nothing."""
    import subprocess

    teacher = Path(args.against).resolve() / "exercises" / "check.py"
    if not teacher.is_file():
        print(f"error: --against={args.against} holds no exercises/check.py; give the folder of the teacher's "
              f"untouched copy of the project.", file=sys.stderr)
        return 1
    command = [sys.executable, str(teacher), args.exercise, f"--answers_from={HERE}"]
    if args.data_root:
        command.append(f"--data_root={args.data_root}")
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
