"""Check your answer to a classroom exercise against the project's own code (docs/exercises.md).

    python exercises/check.py 3                   # exercise 3: "passed" and exit status 0, or what differs and 1
    python exercises/check.py all                 # every exercise, in order, one line each
    python exercises/check.py 4 15                # these exercises, one line each
    python exercises/check.py 5 --data_root=DIR   # where the prepared Shakespeare data lives (default: data/)
    python exercises/check.py 3 --hint            # the first hint; --hint=2 the idea, --hint=3 the code
    python exercises/check.py 3 --hint=3 --against=TEACHER  # (a student) the code, from the teacher's copy
    python exercises/check.py 3 --seed=1234       # the cases a failure was graded on, drawn again
    python exercises/check.py 3 --student=COPY    # (the teacher) grade the answers in a student's copy
    python exercises/check.py 3 --against=TEACHER # (a student) have the teacher's copy grade these answers
    python exercises/check.py all --doc-numbers   # (the teacher) write what each check prints into the docs
    python exercises/check.py all --no-bwrap      # grade without bubblewrap, in the room alone (grader/room.py)

Your answers are the functions in exercises/NN_name.py (NN is the exercise's number). The check computes the
truth in this process from the project's code, runs your functions in a process of their own (grading.py says
why), and prints one line. An answer not written yet, or one that raises an error, is one sentence naming the
function. `--student=COPY` grades COPY's answer files with this copy's checks and project: nothing else of
COPY runs, so what grades is what the teacher holds.
"""

import argparse
import os
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the project's modules (train, model, ...), from any working directory

# The exercises in order: number -> (the module of checks, its check). Exercise N's answers are in exercises/NN_*.py.
# (Imported when a check runs: a hint or a refused argument starts at once.)
CHECKS = {1: ("step", "check_schedule"), 2: ("step", "check_accumulation"), 3: ("step", "check_attention"),
          4: ("cost", "check_mfu"), 5: ("cost", "check_metric"), 6: ("run", "check_resume"), 7: ("run", "check_task"),
          8: ("choices", "check_scaling_law"), 9: ("choices", "check_optimizer"), 10: ("model", "check_gpt_parts"),
          11: ("tokens", "check_bpe"), 12: ("core", "check_adamw"), 13: ("core", "check_clipping"),
          14: ("core", "check_ranks"), 15: ("ddp", "check_ddp"), 16: ("capstone", "check_capstone"),
          17: ("precision", "check_autocast"), 18: ("tokens", "check_pre_tokenizer"),
          19: ("tokens", "check_learned_merges"), 20: ("ddp", "check_no_sync"), 21: ("sampling", "check_kv_cache"),
          22: ("reading", "check_lr_range_test"), 23: ("reading", "check_loss_spike")}
# The checks that train on the Shakespeare data, which --data_root points them to.
TRAINS = {5, 6, 9, 16, 22, 23}

# The numbers docs/exercises.md quotes are what each check prints for the project's answers on this seed, written
# between these two lines by `check.py all --doc-numbers` (tests/test_exercises.py compares them with the checks).
DOC_SEED = 0
DOCS = HERE.parent / "docs" / "exercises.md"
DOC_BLOCK = ("<!-- written by `python exercises/check.py all --doc-numbers`: what each check prints on the project's "
             "answers at --seed=0 -->", "<!-- end of what the checks print -->")


def check_of(number):
    """The check function of exercise `number` (exercises/grader/checks_*.py)."""
    import importlib

    module, name = CHECKS[number]
    return getattr(importlib.import_module(f"exercises.grader.checks_{module}"), name)


def grade(number, folder=HERE, data_root="", seed=None):
    """(passed, the line to print) for exercise `number`, its answers read from `folder`, its cases drawn from
    `seed` (None: a fresh one, printed when the answer fails, so that --seed replays the grading); refused when
    a grading file (room.fingerprint) changed meanwhile, as an answer could make it where the platform lets it."""
    from exercises.grader.room import changed_file, fingerprint

    seed = random.randrange(2**32) if seed is None else seed
    before = fingerprint()
    passed, line = grade_once(number, folder, data_root, seed)
    changed = changed_file(before, fingerprint())
    if changed:  # whatever the answer printed, the grade cannot be trusted
        return False, (f"exercise {number} cannot be graded: {changed} of the grading copy changed while the answer "
                       f"ran; restore it (git checkout -- {changed}) and grade again.")
    return passed, line


def seed_everything(seed):
    """Seed the generators every check draws its cases from (or from random.Random(random.getrandbits(64)))."""
    import numpy as np
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed)


def grade_once(number, folder, data_root, seed):
    from exercises.grader.checking import ExerciseFailed, GraderFailed, NotDone
    from exercises.grader.grading import Answers

    options = {"data_root": data_root} if number in TRAINS else {}
    seed_everything(seed)
    try:
        answers = Answers(number, folder)
        answers.check_written()
        summary = check_of(number)(answers, **options)
    except NotDone as missing:
        return False, f"exercise {number} is not done yet: {missing}"
    except GraderFailed as failure:  # the machine's doing, not the answer's
        return False, (f"exercise {number} could not be graded: the grader could not start your answer: {failure}; "
                       f"tell your teacher.")
    except ExerciseFailed as failure:
        return False, f"exercise {number} failed (--seed={seed} draws these cases again): {failure}"
    except Exception as error:  # noqa: BLE001 - the check itself stopped: still one sentence, naming where
        return False, f"exercise {number} {stopped(error)}"
    return True, f"exercise {number} passed: {summary}"


def stopped(error):
    """The end of the line for a check that stopped on an error of its own: the project no longer does what the
    exercise teaches (an assertion of the check), or what came back from the answer was not what it reads."""
    import traceback

    from exercises.grader.checking import from_the_answer

    last = (traceback.extract_tb(error.__traceback__) or [None])[-1]
    where = f" in {Path(last.filename).name} line {last.lineno}" if last else ""
    # (the error may quote what the answer returned: new lines only, and escaped)
    text = from_the_answer(([line for line in str(error).split("\n") if line.strip()] or [""])[0], 200)
    if isinstance(error, AssertionError):
        return (f"cannot be checked: the project no longer does what it teaches ({text}{where}); tell your "
                f"teacher.")
    return (f"failed: the check stopped on {type(error).__name__} ({text}){where}, reading what your answers "
            f"returned: give each function's result the type its docstring says.")


def main(argv):
    parser = argparse.ArgumentParser(description="Check a classroom exercise against the project's own code.")
    parser.add_argument("exercise", nargs="+", choices=[str(n) for n in CHECKS] + ["all"],
                        help="the exercises' numbers, or all")
    parser.add_argument("--data_root", default="",
                        help="the folder holding shakespeare/ (default: the project's data/)")
    parser.add_argument("--hint", type=int, nargs="?", const=1, default=None,
                        help="print hint number HINT (1: where to look, 2: how, 3: the code) instead of checking")
    parser.add_argument("--seed", type=int, default=None,
                        help="draw the cases of a grading again: the seed a failure printed (default: a fresh one)")
    parser.add_argument("--student", default=None,
                        help="a student's copy of the project: grade its answer files with this copy's checks")
    parser.add_argument("--against", default=None,
                        help="the teacher's untouched copy of the project: it grades this copy's answers")
    parser.add_argument("--no-bwrap", action="store_true",
                        help="run the answers in the room alone, without the bubblewrap sandbox (grader/sandbox.py)")
    parser.add_argument("--doc-numbers", action="store_true",
                        help=f"grade the project's answers at --seed={DOC_SEED} and write what each check prints into "
                             f"docs/exercises.md")
    args = parser.parse_args(argv)
    if "all" in args.exercise and len(args.exercise) > 1:
        return refuse("`all` goes alone; give either all or the exercises' numbers.")
    args.exercise = " ".join(args.exercise)
    if args.doc_numbers and (args.exercise != "all" or args.student or args.against or args.seed not in (None, DOC_SEED)
                             or args.hint is not None):
        return refuse(f"--doc-numbers goes with `all` alone (it grades the project's own answers at "
                      f"--seed={DOC_SEED}).")
    if args.seed is not None and not 0 <= args.seed < 2**32:  # what numpy's generator takes, as a fresh seed is drawn
        return refuse(f"--seed={args.seed} is not a seed a grading prints; give one from 0 to {2**32 - 1}.")
    if args.hint is not None:  # (--hint=0 too: it asks for no hint that exists, so it is refused, not graded)
        if not args.exercise.isdigit():
            return refuse("--hint takes one exercise's number, e.g. check.py 3 --hint.")
        if args.against is None or args.hint != 3:
            return print_hint(int(args.exercise), args.hint)
    if args.against is not None:
        return hand_to_teacher(args)
    folder = HERE
    if args.student is not None:
        student = Path(args.student).resolve() if args.student else None
        if student is None or not student.is_dir():
            return refuse(f"--student={args.student} is not a folder; give the folder of the student's copy.")
        folder = student / "exercises" if (student / "exercises").is_dir() else student
    if args.data_root and not os.path.isdir(args.data_root):  # before anything is prepared or written there
        return refuse(f"--data_root={args.data_root} is not a folder; give the folder that holds shakespeare/ "
                      f"(or leave it out to use the project's data/).")
    import torch

    from exercises.grader.grading import sandbox

    box = sandbox(use_bwrap=not args.no_bwrap)  # says in one line (stderr) where the answers run, if there is news
    if box.bwrap is None and box.as_grader and os.geteuid() == 0:
        # (without the sandbox's read-only system, root's file rights reach root's files and sockets machine-wide)
        return refuse(f"as root without bubblewrap the answers would run as root, with the owner's rights to root's "
                      f"files, since {box.as_grader} (Python) is closed to other users; open it to them (chmod -R "
                      f"o+rX {box.as_grader}) or grade where bubblewrap starts.")
    numbers = list(CHECKS) if args.exercise == "all" else [int(n) for n in args.exercise.split()]
    torch.set_num_threads(1)  # the checks' models are tiny: a second thread only waits (see checking.py)
    results, lines = [], {}
    for number in numbers:
        passed, lines[number] = grade(number, folder, args.data_root, DOC_SEED if args.doc_numbers else args.seed)
        print(lines[number], flush=True)
        results.append(passed)
    if args.doc_numbers:
        if not all(results):
            return refuse("a check failed on the project's own answers, so docs/exercises.md is left as it was.")
        DOCS.write_text(with_doc_numbers(DOCS.read_text(encoding="utf-8"), lines), encoding="utf-8")
        print(f"wrote what the {len(lines)} checks print into {DOCS.relative_to(HERE.parent)}")
    return 0 if all(results) else 1


def doc_row(number, line):
    """The docs' table row of what exercise `number`'s check printed (its pass line, the "exercise N passed: " cut)."""
    return f"| {number} | {line.split(': ', 1)[1].replace('|', '&#124;')} |"


def with_doc_numbers(text, lines):
    """`text` (docs/exercises.md) with its block of what the checks print replaced by `lines` ({number: line})."""
    start, end = text.index(DOC_BLOCK[0]), text.index(DOC_BLOCK[1])
    rows = [DOC_BLOCK[0], "", "| # | what the check prints |", "| --- | --- |",
            *(doc_row(number, line) for number, line in sorted(lines.items())), ""]
    return text[:start] + "\n".join(rows) + "\n" + text[end:]


def refuse(sentence):
    print(f"error: {sentence}", file=sys.stderr)
    return 1


def print_hint(number, level):
    """Hint `level` of exercise `number`, from hints.py: where to look, then how, then the code."""
    from exercises.grader.hints import hint

    try:
        text, count = hint(number, level)
    except ValueError as error:
        return refuse(str(error))
    more = f" (more: --hint={level + 1})" if level < count else " (the last one)"
    print(f"exercise {number}, hint {level} of {count}{more}: {text}")
    return 0


def hand_to_teacher(args):
    """Start the teacher's check.py on this copy's answers (`--student`). What grades is the teacher's copy; this
    is only a shortcut to it, and the teacher runs the same command from their own copy."""
    import subprocess

    if not args.against:
        return refuse("--against= is empty; give the folder of the teacher's untouched copy of the project.")
    teacher = Path(args.against).resolve()
    if teacher == HERE.parent:
        return refuse(f"--against={args.against} is this copy itself; give the folder of the teacher's untouched "
                      f"copy of the project.")
    if not (teacher / "exercises" / "check.py").is_file():
        return refuse(f"--against={args.against} holds no exercises/check.py; give the folder of the teacher's "
                      f"untouched copy of the project.")
    command = [sys.executable, str(teacher / "exercises" / "check.py"), *args.exercise.split()]
    command += [f"--hint={args.hint}"] if args.hint is not None else [f"--student={HERE.parent}"]
    if args.data_root:
        command.append(f"--data_root={args.data_root}")
    if args.seed is not None:
        command.append(f"--seed={args.seed}")
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
