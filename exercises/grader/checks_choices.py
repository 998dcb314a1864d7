"""The checks of exercises 8 and 9: two choices a run is built on, how much data and which optimizer.

Each compares the student's answers with the project's code (checking.py says how a check works, and
grading.py how the answer runs apart): 8 reading a scaling law (scaling_law.py, on random laws and a
synthetic ladder), 9 the optimizers' split (optimizer.py's param_groups, then AdamW and Muon on the same tokens).
"""

import math
import multiprocessing
import os
import random
import tempfile

import numpy as np

from exercises.grader.checking import ExerciseFailed, compared, is_close, run_training, shown
from exercises.grader.feed_choices import law_answers, named_groups, split_answers, split_models

# ----------------------------------------------------------------------------- 8. reading a scaling law


def random_law(rng):
    return {"E": rng.uniform(1, 3), "A": rng.uniform(100, 1000), "alpha": rng.uniform(0.2, 0.5),
            "B": rng.uniform(100, 2000), "beta": rng.uniform(0.2, 0.5)}


def law_text(law):
    return f"E {law['E']:.3g}, A {law['A']:.4g}, alpha {law['alpha']:.3g}, B {law['B']:.4g}, beta {law['beta']:.3g}"


def compare_law_readings(law, n, d, loss, mine):
    """Raise ExerciseFailed at the first of the three readings that differs from scaling_law's."""
    from lab import scaling_law

    readings = [
        ("predict_loss", f"N {n:.3g}, D {d:.3g}", scaling_law.predict(law, n, d), "scaling_law.predict",
         "check the formula in the module docstring"),
        ("tokens_for_loss", f"N {n:.3g}, loss {loss:.5g}", scaling_law.tokens_to_reach(law, n, loss),
         "scaling_law.tokens_to_reach", "solve the law for D; a loss at or below E + A / N^alpha is never reached "
                                        "(math.inf)"),
        ("tokens_per_param_at_optimum", f"N {n:.3g}", scaling_law.optimal_tokens_per_param(law, n),
         "scaling_law.optimal_tokens_per_param", "solve alpha x A / N^alpha = beta x B / D^beta for D, then divide "
                                                 "by N"),
    ]
    for (name, inputs, want, source, advice), value in zip(readings, mine):
        if isinstance(value, dict) and "raised" in value:
            raise ExerciseFailed(f"{name}({inputs}) raised {value['raised']} where {source} returns a number for the "
                                 f"law {law_text(law)}: {advice}.")
        if not is_close(value, want, rel=1e-6):
            raise ExerciseFailed(f"{name}({inputs}) is {shown(value)}, {compared(value, want)} what {source} gives "
                                 f"for the law {law_text(law)}: {advice}.")


def check_scaling_law(answers):
    from lab import scaling_law

    rng = np.random.default_rng()
    cases = []
    for _ in range(40):
        law, n, d = random_law(rng), 10 ** rng.uniform(6, 11), 10 ** rng.uniform(8, 13)
        floor = law["E"] + law["A"] / n ** law["alpha"]  # the loss of this N with infinite data
        reachable = scaling_law.predict(law, n, 10 ** rng.uniform(8, 13))
        cases += [(law, n, d, loss) for loss in (reachable, floor - rng.uniform(0.001, 0.5))]
    # A loss exactly at the floor E + A / N^alpha (2.0 + 5000 / 1e8^0.5 = 2.5, exact in floating point): with
    # infinite data the loss only tends to it, so it is never reached.
    cases.append(({"E": 2.0, "A": 5000.0, "alpha": 0.5, "B": 400.0, "beta": 0.3}, 1e8, 1e10, 2.5))
    # A synthetic ladder: three sizes, each trained to 10, 20 and 40 tokens per parameter, losses from a
    # known law with 0.2% noise, fitted as ladder.py fits (but from one start near the truth, to stay
    # fast: ladder.py searches a grid of 4,500 starts). The noise is seeded, so the figures below are
    # the same every time (docs/exercises.md quotes them).
    truth, sizes = {"E": 1.8, "A": 480.0, "alpha": 0.35, "B": 1200.0, "beta": 0.32}, (2e6, 4e6, 8e6)
    noise = np.random.default_rng(0)
    points = [(n, k * n, scaling_law.predict(truth, n, k * n) * math.exp(noise.normal(0, 0.002)))
              for n in sizes for k in (10, 20, 40)]
    fitted = scaling_law.fit_law(points, starts=[scaling_law.log_vector(truth) + noise.normal(0, 0.1, 5)])
    law = {name: float(fitted[name]) for name in truth}
    held = 4 * sizes[-1]  # a size 4x beyond the ladder
    cases.append((law, held, 20 * held, scaling_law.predict(law, held, 20 * held)))
    cases = [({k: float(v) for k, v in c[0].items()}, *map(float, c[1:])) for c in cases]  # plain numbers
    for case, mine in zip(cases, answers.run(law_answers, cases)):
        compare_law_readings(*case, mine)
    law = cases[-1][0]
    return (f"your readings match scaling_law.py on 80 random laws; on a synthetic 3-size ladder the fitted law "
            f"predicts a 4x larger model's loss at 20 tokens per parameter as "
            f"{scaling_law.predict(law, held, 20 * held):.4f} (true: "
            f"{scaling_law.predict(truth, held, 20 * held):.4f}), and puts its compute optimum at "
            f"{scaling_law.optimal_tokens_per_param(law, held):.0f} tokens per parameter (true: "
            f"{scaling_law.optimal_tokens_per_param(truth, held):.0f}).")


# ----------------------------------------------------------------------------- 9. AdamW and Muon


GROUP_REASONS = {
    "muon": "Muon owns the 2-D weights inside the transformer blocks",
    "decay": "AdamW decays the matrices, the embeddings too unless optim.decay_embeddings=false (and, under Muon, "
             "the embeddings stay with AdamW)",
    "no_decay": "biases and LayerNorm gains are never decayed, nor the embeddings with optim.decay_embeddings=false",
}


def compare_groups(mine, want, settings):
    """Raise ExerciseFailed at the first parameter that the student's split puts elsewhere than optimizer.py."""
    if not isinstance(mine, dict) or set(mine) != set(want):
        raise ExerciseFailed(f"with {settings}, your groups are {sorted(mine) if isinstance(mine, dict) else mine!r} "
                             f"where the project's are {sorted(want)}: \"muon\" exists only under optim.name=muon.")
    owner = {}
    for group, names in mine.items():
        for name in names:
            if name in owner:
                raise ExerciseFailed(f"{name} is in both your {owner[name]!r} and {group!r} groups: every parameter "
                                     f"has one optimizer.")
            owner[name] = group
    for group, names in want.items():
        for name in names:
            if owner.get(name) != group:
                where = f"your {owner[name]!r} group" if name in owner else "none of your groups"
                raise ExerciseFailed(f"with {settings}, {name} is in {where} where optimizer.py puts it in {group!r}: "
                                     f"{GROUP_REASONS[group]}.")
    stranger = next((name for name in owner if name.startswith("a tensor")), None)
    if stranger:
        raise ExerciseFailed(f"with {settings}, your {owner[stranger]!r} group holds {stranger} that is not one of the "
                             f"model's parameters.")


def final_val_loss(data_root, out, name, steps):
    """The val loss after `steps` of a small GPT trained with optimizer `name` on the Shakespeare data."""
    rows = run_training([f"--data.data_root={data_root}", f"--train.out_dir={out}", f"--optim.name={name}",
                         "--model.n_layer=2", "--model.n_head=4", "--model.n_embd=64", "--model.block_size=64",
                         "--data.batch_size=8", "--train.total_batch_size=512", f"--train.max_steps={steps}",
                         "--optim.lr=2e-3", "--optim.min_lr=2e-4", f"--optim.warmup_steps={max(1, steps // 8)}",
                         f"--eval.interval={steps}", "--eval.val_steps=4", "--eval.sample_interval=0",
                         "--train.no_checkpoints=true"])
    return rows[-1]["val/loss"]


def check_optimizer(answers, data_root="", steps=20):
    import optimizer

    cases = [{"seed": random.randrange(2**31), "n_layer": random.randint(1, 3), "name": name,
              "decay_embeddings": decay_embeddings, "bias": bias}
             for name in ("adamw", "muon") for decay_embeddings in (True, False) for bias in (True, False)]
    for case, (model, optim), mine in zip(cases, split_models(cases), answers.run(split_answers, cases)):
        settings = f"optim.name={case['name']}, optim.decay_embeddings={case['decay_embeddings']}, bias={case['bias']}"
        compare_groups(mine, named_groups(optimizer.param_groups(model, optim), model), settings)
    # The split is the project's, so the project trains the same tokens through both optimizers built from it: AdamW's
    # run in a child process meanwhile where the platform forks (one core each), else one after the other.
    with tempfile.TemporaryDirectory() as tmp:
        if hasattr(os, "fork"):
            with multiprocessing.get_context("fork").Pool(1) as pool:
                adamw = pool.apply_async(final_val_loss, (data_root, f"{tmp}/adamw", "adamw", steps))
                final = {"muon": final_val_loss(data_root, f"{tmp}/muon", "muon", steps), "adamw": adamw.get()}
        else:
            final = {name: final_val_loss(data_root, f"{tmp}/{name}", name, steps) for name in ("adamw", "muon")}
    return (f"param_groups matches optimizer.py on 8 models and settings; with that split, on the same {steps * 512:,} "
            f"tokens ({steps} steps), AdamW reaches val loss {final['adamw']:.3f} and Muon {final['muon']:.3f}.")
