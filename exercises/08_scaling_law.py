"""Exercise 8: a 3-size ladder, and reading its law.

Goal: read a scaling law L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022), the law the
model ladder fits to a few small runs (N parameters, D training tokens) to predict a larger one: the
loss it predicts, the data a model of N parameters needs to reach a given loss, and the
compute-optimal number of tokens per parameter (Chinchilla's "20").
In the project: lab/scaling_law.py, `fit_law`, `predict`, `tokens_to_reach`, `optimal_tokens_per_param`;
ladder.py, `fit` (lab/ladder_fit.py: it fits the small sizes and checks the prediction for the largest).
Check: python exercises/check.py 8
(your three functions against the project's on random laws, then on the law fitted to a synthetic
3-size ladder whose true law is known)
"""

import math


def predict_loss(law, n, d):
    """The loss the law predicts for a model of `n` parameters trained on `d` tokens. `law` is a dict
    with keys E, A, alpha, B, beta, as lab/scaling_law.py's fit_law returns it."""
    return law["E"] + law["A"] / n ** law["alpha"] + law["B"] / d ** law["beta"]


def tokens_for_loss(law, n, loss):
    """The training tokens D at which a model of `n` parameters reaches `loss`; math.inf when it never
    does, however long it trains.
    """
    gap = loss - law["E"] - law["A"] / n ** law["alpha"]
    if gap <= 0:
        return math.inf
    return (law["B"] / gap) ** (1 / law["beta"])


def tokens_per_param_at_optimum(law, n):
    """D / N for the compute-optimal run of a model of `n` parameters: of all (N, D) with the same
    compute C = 6 N D, the one with the lowest predicted loss has this N, and this many tokens per
    parameter.
    """
    alpha, beta = law["alpha"], law["beta"]
    d = (beta * law["B"] * n ** alpha / (alpha * law["A"])) ** (1 / beta)
    return d / n
