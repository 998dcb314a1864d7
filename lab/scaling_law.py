"""Scaling laws: the fits the model ladder makes from its measurements (ladder.py calls these).

- `fit_law`: L(N, D) = E + A / N^alpha + B / D^beta fitted to (N, D, loss) points as Hoffmann et al.
  2022 (approach 3): the Huber loss (delta 1e-3) of log L, minimised by L-BFGS from a grid of
  starts.
- `bootstrap`: the spread of every fitted number. Besiroglu et al. 2024 (the Chinchilla replication)
  showed that a single fitted number without an interval misleads; here the residuals of the fit (in
  log space) are resampled onto the fitted curve and the law refitted, many times (a residual
  bootstrap keeps the measured sizes and durations, which a handful of points needs).
- `fit_sigmoid`: the second step of OLMo's ladder (Bhagia et al. 2024, "Establishing Task Scaling
  Laws via Compute-Efficient Model Ladders"): a task's accuracy as a sigmoid of its task loss (the
  correct answer's loss per character), so that step one (the law, fitted to task losses) and step
  two chain into a predicted accuracy.
- `compute_multiplier`: how much more compute one law needs than another to reach the same loss.
"""

import itertools
import math

import numpy as np

INTERVAL = 0.9  # the intervals reported: 5th to 95th percentile of the bootstrap


def law_terms(p, log_n, log_d):
    a, b, e, alpha, beta = p
    return np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])


def fit_law(points, delta=1e-3, starts=None):
    """{E, A, alpha, B, beta, converged} fitted to [(N, D, loss)]. `starts` (log-space parameter
    vectors [a, b, e, alpha, beta]) replace the grid: a bootstrap starts from the fit it perturbs.
    """
    from scipy.optimize import minimize

    log_n, log_d, log_l = (np.log(np.array(column, dtype=float)) for column in zip(*points))

    def huber(residual):
        small = np.abs(residual) <= delta
        return np.where(small, 0.5 * residual**2, delta * (np.abs(residual) - 0.5 * delta)), small

    def objective(p):
        terms = law_terms(p, log_n, log_d)  # log of each of the three terms, per point
        top = terms.max(axis=0)
        exp = np.exp(terms - top)
        total = exp.sum(axis=0)
        residual = top + np.log(total) - log_l  # log(sum of the terms) - log L, computed stably
        loss, small = huber(residual)
        slope = np.where(small, residual, delta * np.sign(residual))
        # d loss / d term (the softmax of the terms, times the Huber slope)
        weights = exp / total * slope
        grad = [weights[0].sum(), weights[1].sum(), weights[2].sum(), -(weights[0] * log_n).sum(),
                -(weights[1] * log_d).sum()]
        return loss.sum(), np.array(grad)

    if starts is None:
        # Hoffmann et al.'s grid of 4,500 starting points, scored at once; L-BFGS runs from the 50
        # where the objective is already lowest, finishing with tolerances tight enough for Huber
        # losses of 1e-10 and below (scipy's defaults stop early). A test checks that this recovers
        # a known law.
        starts = itertools.product(range(0, 30, 5), range(0, 30, 5), (-1, -0.5, 0, 0.5, 1),
                                   (0, 0.5, 1, 1.5, 2), (0, 0.5, 1, 1.5, 2))
        grid = np.array(list(starts), dtype=float)
        a, b, e, alpha, beta = (grid[:, [k]] for k in range(5))  # each (4500, 1) against the points
        terms = np.stack([a - alpha * log_n, b - beta * log_d,
                          np.broadcast_to(e, (len(grid), len(log_n)))])
        top = terms.max(axis=0)
        scores = huber(top + np.log(np.exp(terms - top).sum(axis=0)) - log_l)[0].sum(axis=1)
        starts = grid[np.argsort(scores)[:50]]
    # alpha, beta in [0, 10]: loss never rises with more parameters or more data, and no measured
    # exponent is near 10 (Hoffmann et al.: 0.34, 0.28); the cap keeps a degenerate fit (N that
    # barely varies) finite.
    bounds = [(None, 300)] * 2 + [(None, None)] + [(0, 10)] * 2

    def descend(start, tight):
        options = {"ftol": 1e-15, "gtol": 1e-12} if tight else {}
        return minimize(objective, start, jac=True, method="L-BFGS-B", bounds=bounds,
                        options=options)

    # Every start with scipy's default tolerances, then the 3 best again with tight ones: the same
    # optimum as tight tolerances from every start, in a third of the time (measured on 2 CPU
    # cores).
    rough = sorted((descend(start, tight=False) for start in starts), key=lambda r: r.fun)[:3]
    best = min((descend(r.x, tight=True) for r in rough), key=lambda r: r.fun)
    a, b, e, alpha, beta = (float(v) for v in best.x)
    return {"E": math.exp(e), "A": math.exp(a), "alpha": alpha, "B": math.exp(b), "beta": beta,
            "converged": bool(best.success), "message": str(best.message)}


def log_vector(params):
    return np.array([math.log(params["A"]), math.log(params["B"]), math.log(params["E"]),
                     params["alpha"],
                     params["beta"]])


def predict(params, n, d):
    return params["E"] + params["A"] / n ** params["alpha"] + params["B"] / d ** params["beta"]


def bootstrap(points, params, rounds=200, seed=0):
    """`rounds` refits on resampled data: the fitted loss at each point times exp(a residual drawn,
    with replacement, from the fit's log residuals). Returns the refitted parameter dicts (converged
    ones)."""
    rng = np.random.default_rng(seed)
    fitted = np.array([predict(params, n, d) for n, d, _ in points])
    residuals = np.log([loss for _, _, loss in points]) - np.log(fitted)
    start = log_vector(params)
    refits = []
    for _ in range(rounds):
        losses = fitted * np.exp(rng.choice(residuals, size=len(points), replace=True))
        refit = fit_law([(n, d, loss) for (n, d, _), loss in zip(points, losses)], starts=[start])
        if refit["converged"]:
            refits.append(refit)
    return refits


def interval(values, level=INTERVAL):
    """(low, high): the central `level` of `values` (finite ones)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return (float("nan"), float("nan"))
    low, high = np.percentile(finite, [50 * (1 - level), 50 * (1 + level)])
    return (float(low), float(high))


def optimal_tokens_per_param(params, n):
    """D/N at the compute-optimal point for a model of N parameters (C = 6ND; Hoffmann et al. 2022,
    eq. 4)."""
    alpha, beta, A, B = params["alpha"], params["beta"], params["A"], params["B"]
    if alpha <= 0 or beta <= 0:  # loss that does not fall with N or with D: no optimum to speak of
        return float("nan")
    try:
        g = (alpha * A / (beta * B)) ** (1 / (alpha + beta))
        compute_over_6 = (n / g) ** ((alpha + beta) / beta)
        return compute_over_6 / n / n
    except (ZeroDivisionError, OverflowError, ValueError):
        return float("nan")


# ---------------------------------------------------------------- step two: task loss -> accuracy


def sigmoid(params, loss):
    """Accuracy at task loss `loss`: from `top` (low loss) down to `floor` (chance, high loss)."""
    return params["floor"] + (params["top"] - params["floor"]) / (
        1 + math.exp(params["k"] * (loss - params["loss_mid"]))
    )


def fit_sigmoid(losses, accuracies, floor=None):
    """{floor, top, k, loss_mid} fitted by least squares to (task loss, accuracy) pairs (OLMo's step
    two). `floor`, the accuracy of chance, is held fixed when given: small models sit at it and
    cannot tell it apart from the rest of the curve."""
    from scipy.optimize import least_squares

    x, y = np.array(losses, dtype=float), np.array(accuracies, dtype=float)
    fixed_floor = floor is not None

    def unpack(p):
        return (floor if fixed_floor else p[3]), p[0], p[1], p[2]

    def residuals(p):
        lo, top, k, mid = unpack(p)
        return lo + (top - lo) / (1 + np.exp(np.clip(k * (x - mid), -50, 50))) - y

    start = [max(y.max(), 0.5), 5.0,
             float(np.median(x))] + ([] if fixed_floor else [min(y.min(), 0.25)])
    bounds = ([0, 0, -np.inf] + ([] if fixed_floor else [0]),
              [1, np.inf, np.inf] + ([] if fixed_floor else [1]))
    result = least_squares(residuals, start, bounds=bounds)
    lo, top, k, mid = unpack(result.x)
    return {"floor": float(lo), "top": float(top), "k": float(k), "loss_mid": float(mid),
            "converged": bool(result.success)}


# ----------------------------------------------------------------------------- comparing two laws


def tokens_to_reach(params, n, loss):
    """D at which a model of N parameters reaches `loss` under the law (inf when it never does)."""
    gap = loss - params["E"] - params["A"] / n ** params["alpha"]
    if gap <= 0 or params["beta"] <= 0:
        return float("inf")
    return (params["B"] / gap) ** (1 / params["beta"])


def compute_multiplier(law_a, law_b, n, d, at="b"):
    """How many times the compute (6ND at the same N) A needs to reach the loss that B has at (N, D)
    (`at="b"`): above 1, B is the better recipe by that factor; inf when A never gets there at this
    size. `at="a"` asks the same question at A's loss at (N, D): D over the tokens B needs to reach
    it (0 when B never does). The two differ when the multiplier changes with the loss."""
    if at == "b":
        return tokens_to_reach(law_a, n, predict(law_b, n, d)) / d
    return d / tokens_to_reach(law_b, n, predict(law_a, n, d))


# ------------------------------------------------------------------------------------ the picture


def plot_fit(finished, law, refits, params, path):
    """fit.png: each size's measured post-decay losses (points), the fitted law's curve for it
    (lines), the held-out size (the last) dashed with its bootstrap band, and the law in the title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4
    for k, ((plan, points), color) in enumerate(zip(finished, colors)):
        held = k == len(finished) - 1
        n = plan.params[params]
        tokens = [d for d, _, _ in points]
        curve = np.geomspace(min(tokens) / 2, max(tokens) * 2, 100)
        ax.plot(curve, [predict(law, n, d) for d in curve], color=color, linewidth=1,
                linestyle="--" if held else "-")
        if held and refits:
            bands = [interval([predict(r, n, d) for r in refits]) for d in curve]
            ax.fill_between(curve, [b[0] for b in bands], [b[1] for b in bands], color=color,
                            alpha=0.2,
                            label=f"{INTERVAL:.0%} interval (bootstrap)")
        ax.scatter(tokens, [loss for _, loss, _ in points], color=color, zorder=3,
                   marker="*" if held else "o",
                   s=120 if held else 30,
                   label=f"{plan.size} (N = {n:,})" + (", held out" if held else ""))
    ax.set_xscale("log")
    ax.set_xlabel("training tokens D")
    ax.set_ylabel("validation loss")
    ax.set_title(f"L(N, D) = {law['E']:.3f} + {law['A']:.3g}/N^{law['alpha']:.3f} + "
                 f"{law['B']:.3g}/D^{law['beta']:.3f}  (N: {params})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
