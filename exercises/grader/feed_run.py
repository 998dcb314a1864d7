"""What the answer's process runs for exercises 6 and 7 (checks_run.py grades them): a real run stopped and
resumed with the answer's four functions in place of the project's, and the answer's RTE task. feeding.py says
what a feed module is, and holds."""

import random
import tempfile

import numpy as np
import torch

from exercises.grader.feeding import TINY_RUN, patched, run_training

FIELDS = ("step", "tokens", "best_val_loss", "data")  # what a TrainState holds to resume


def fields_of(state):
    """A TrainState's fields as they are now (the loop goes on changing the original), as plain data."""
    return {name: getattr(state, name) for name in FIELDS} | {"data": dict(state.data)
                                                              if isinstance(state.data, dict) else state.data}


def generators():
    """This process's four generators, as plain data (NumPy's keys as a tensor)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss)}


def resume_run(data_root, out, *extra):
    return run_training(TINY_RUN + [f"--data.data_root={data_root}", "--train.max_steps=8", "--eval.interval=2",
                                    "--model.dropout=0.1", "--checkpoint.interval=0",  # dropout draws from torch's RNG
                                    f"--train.out_dir={out}", *extra])


def resume_answers(answers, data_root):
    import checkpoint
    from checkpoint import TrainState
    from exercises.grader.runner import describe_error

    saved, restored = {}, {}  # what the run had when it saved; what came back when it resumed

    def to_dict(state):
        saved[state.step] = {"state": fields_of(state)}
        saved["last"] = state.step
        return answers.trainer_state_to_dict(state)

    def rng_state(generator):  # Checkpointer.save calls it right after to_dict, for the same step
        saved[saved["last"]].update(generators(), sample=generator.get_state())
        return answers.rng_state(generator)

    def set_rng_state(state, generator):
        answers.set_rng_state(state, generator)
        restored.update(generators(), sample=generator.get_state())

    def from_dict(cls, data):
        state = answers.trainer_state_from_dict(data)
        restored["state"] = fields_of(state) if isinstance(state, TrainState) else type(state).__name__
        return state

    resumed, error = [], None
    with tempfile.TemporaryDirectory() as out, patched(TrainState, "to_dict", to_dict), \
            patched(TrainState, "from_dict", classmethod(from_dict)), patched(checkpoint, "rng_state", rng_state), \
            patched(checkpoint, "set_rng_state", set_rng_state):
        resume_run(data_root, out, "--train.hard_stop=4")
        random.random(), np.random.random()  # a resuming process's Python and NumPy generators are elsewhere
        try:
            resumed = resume_run(data_root, out)
        except Exception as failure:  # noqa: BLE001 - what came back wrong explains it better; else said after
            error = describe_error(answers.__file__, failure)
    rows = [(row["step"], row.get("train/loss"), row.get("tokens")) for row in resumed]
    return {"saved": saved.get(4), "restored": restored, "rows": rows, "error": error}


def task_answers(answers, docs):
    import hellaswag_eval

    task = answers.rte_task()
    fields = {"type": type(task).__name__, "is_task": isinstance(task, hellaswag_eval.Task)}
    if fields["is_task"]:
        fields.update(folder=task.folder, hub=tuple(task.hub), primary=task.primary,
                      format_is_rte=task.format is answers.rte)
    return {"task": fields, "formatted": [answers.rte(doc) for doc in docs]}
