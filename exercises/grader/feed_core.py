"""What the answer's process runs for exercises 12 to 14 (checks_core.py grades them): three steps of the
answer's AdamW update, its clipping, its ranks' split. feeding.py says what a feed module is, and holds."""

import torch


def adamw_answers(answers, cases):
    results = []
    for case in cases:
        param = case["param"].clone()
        exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
        steps = []
        for step, grad in enumerate(case["grads"], 1):
            given = grad.clone()
            answers.adamw_update(param, given, exp_avg, exp_avg_sq, step, case["lr"], case["beta1"], case["beta2"],
                                 case["eps"], case["weight_decay"])
            steps.append({"param": param.clone(), "exp_avg": exp_avg.clone(), "exp_avg_sq": exp_avg_sq.clone(),
                          "grad": given.clone()})
        results.append(steps)
    return results


def clipping_answers(answers, cases):
    results = []
    for case in cases:
        parameters = [torch.nn.Parameter(torch.zeros(g.shape)) for g in case["grads"]]
        for p, g in zip(parameters, case["grads"]):
            p.grad = g.clone()
        norm = answers.clip_gradients(parameters + [torch.nn.Parameter(torch.zeros(2))], case["limit"])  # no grad
        results.append({"norm": norm, "grads": [p.grad for p in parameters]})
    return results


def ranks_answers(answers, cases):
    return [answers.rank_sequences(*case) for case in cases]
