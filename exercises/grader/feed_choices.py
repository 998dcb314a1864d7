"""What the answer's process runs for exercises 8 and 9 (checks_choices.py grades them): the answer's readings
of scaling laws, and its split of tiny GPTs' parameters into optimizer groups. feeding.py says what a feed module
is, and holds."""

from exercises.grader.feeding import tiny_gpt


READINGS = ("predict_loss", "tokens_for_loss", "tokens_per_param_at_optimum")


def law_answers(answers, cases):
    """Each reading of each case: its value, or the arithmetic error it raised (by name)."""
    results = []
    for law, n, d, loss in cases:
        row = []
        for name, args in zip(READINGS, ((law, n, d), (law, n, loss), (law, n))):
            try:
                row.append(getattr(answers, name)(*args))
            except ArithmeticError as error:  # e.g. a division by the gap at the floor itself
                row.append({"raised": type(error).__name__})
        results.append(row)
    return results


def split_models(cases):
    """(model, OptimConfig) of each case: the same models on both sides, built from the same seeds."""
    from config import OptimConfig

    return [(tiny_gpt(case["seed"], n_layer=case["n_layer"], bias=case["bias"]),
             OptimConfig(name=case["name"], decay_embeddings=case["decay_embeddings"])) for case in cases]


def named_groups(groups, model):
    """{group: [parameter names]} of a split, a parameter named by the model (or by its shape, if not its own)."""
    names = {id(p): name for name, p in model.named_parameters()}
    if not isinstance(groups, dict):
        return groups
    return {group: [names.get(id(p), f"a tensor of shape {tuple(getattr(p, 'shape', ()))}") for p in params]
            for group, params in groups.items()}


def split_answers(answers, cases):
    return [named_groups(answers.param_groups(model, optim), model) for model, optim in split_models(cases)]
