"""What the answer's process runs for exercises 4 and 5 (checks_cost.py grades them): GPTs built on the meta
device for the FLOP count, and a real 6-step training run that calls the answer's metric after each step.
feeding.py says what a feed module is, and holds."""

import tempfile

import torch

from exercises.grader.feeding import TINY_RUN, host_syncs, patched, run_training


def mfu_answers(answers, inputs):
    from model import GPT, GPTConfig

    counts = []
    for shape in inputs["shapes"]:
        with torch.device("meta"):  # shapes only: even a large model costs no memory
            counts.append(answers.flops_per_token(GPT(GPTConfig(**shape))))
    return {"flops": counts, "mfu": [answers.mfu(*speed) for speed in inputs["speeds"]]}


class RecorderSpy:
    """The run's MetricRecorder as the student's function sees it: it notes what is recorded, and how."""

    def __init__(self, recorder, notes):
        self.recorder, self.notes = recorder, notes

    def record_metric(self, name, value, reduce="mean", merge="warn"):
        self.notes.append({"name": name, "is_tensor": torch.is_tensor(value), "type": type(value).__name__,
                           "reduce": reduce})
        self.recorder.record_metric(name, value, reduce, merge)

    def record_all(self, values, reduce="mean"):
        for name, value in values.items():
            self.record_metric(name, value, reduce)


def metric_run(data_root, out, after_step):
    """A 6-step tiny run, calling after_step(run, raw_model, weights_before) after each step; its rows."""
    import train

    original_build_run, original_train_step = train.build_run, train.train_step
    runs = []

    def build_run(cfg, stack):  # the same run, kept to reach its recorder
        runs.append(original_build_run(cfg, stack))
        return runs[-1]

    def train_step(model, optimizer, loader, *args, **kwargs):  # the project's step, then the metric
        raw_model = runs[-1].raw_model
        before = {name: p.detach().clone() for name, p in raw_model.named_parameters()}
        result = original_train_step(model, optimizer, loader, *args, **kwargs)
        after_step(runs[-1], raw_model, before)
        return result

    with patched(train, "build_run", build_run), patched(train, "train_step", train_step):
        return run_training(TINY_RUN + [f"--data.data_root={data_root}", f"--train.out_dir={out}",
                                        "--train.max_steps=6", "--eval.interval=0", "--train.no_checkpoints=true",
                                        "--log.metrics_collect_interval=3"])


def metric_answers(answers, data_root):
    notes, syncs = [], []

    def record(run, raw_model, before):
        with host_syncs() as calls:
            answers.record_update_ratio(RecorderSpy(run.books.recorder, notes), raw_model, before)
        syncs.extend(calls)

    with tempfile.TemporaryDirectory() as out:
        rows = metric_run(data_root, out, record)
    return {"logged": [row.get("optim/update_ratio") for row in rows], "notes": notes, "syncs": syncs}
