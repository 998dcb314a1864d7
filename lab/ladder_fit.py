"""What the model ladder's runs say: the scaling-law fit with its held-out check, the two-step task
prediction, and two ladders compared (`python ladder.py fit` and `python ladder.py compare`;
ladder.py plans and trains the sizes, scaling_law.py holds the mathematics).

    python ladder.py fit     config/ladder_shakespeare.py [--params=...] [--task=NAME]
                                                          [--rounds=200]
    python ladder.py compare config/ladder_shakespeare.py config/ladder_shakespeare_muon.py
"""

import json
import math
import os
import re

from lab import scaling_law
from checkpoint import is_complete_checkpoint
from config import UserError
from configurator.model import PARAMS
from hellaswag_eval import TASKS


# -------------------------------------------------------------------- reading what the runs wrote


def size_folders(cfg, size):
    """Where a size's checkpoints and metrics are looked for, in order: ladder.dir, then each of
    ladder.alternative_dirs (OLMo-core's), a local folder or a bucket URL, with the size appended.
    """
    others = [f"{d.rstrip('/')}/{size}" for d in cfg.ladder.alternative_dirs]
    return [os.path.join(cfg.ladder.dir, size)] + others


def missing_alternative_dirs(cfg):
    """The ladder.alternative_dirs (folders or bucket URLs) that do not exist: nothing is found
    there, which a listing of "✘" alone would not say."""
    missing = []
    for folder in cfg.ladder.alternative_dirs:
        if "://" in folder:
            from lab import remote

            fs, root = remote.filesystem(folder, "ladder.alternative_dirs")
            exists = fs.exists(root)
        else:
            exists = os.path.isdir(folder)
        if not exists:
            missing.append(folder)
    return missing


def listing(folder):
    """(complete checkpoint steps, metrics_step<N>.json steps) of a local folder or a bucket URL ({}
    when missing)."""
    if "://" in folder:
        from lab import remote

        fs, root = remote.filesystem(folder, "ladder.alternative_dirs")
        names = []
        if fs.exists(root):
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
        complete = set(remote.complete_checkpoints(fs, root))
    else:
        names = os.listdir(folder) if os.path.isdir(folder) else []
        complete = {int(n[4:]) for n in names if n.startswith("step") and n[4:].isdigit()
                    and is_complete_checkpoint(os.path.join(folder, n))}
    snapshots = [re.fullmatch(r"metrics_step(\d+)\.json", n) for n in names]
    metrics = {int(match.group(1)) for match in snapshots if match}
    return complete, metrics


def inside(folder, name):
    """`folder`/`name`, for a local folder or a bucket URL."""
    return f"{folder}/{name}" if "://" in folder else os.path.join(folder, name)


def checkpoint_rows(cfg, plan):
    """[{name, step, tokens, path, exists, metrics}] of the planned checkpoints (with
    ladder.discover_all, of every checkpoint found), in step order; each is looked for in
    size_folders, the first folder that has it wins."""
    folders = size_folders(cfg, plan.size)
    found = {folder: listing(folder) for folder in folders}
    planned = dict((step, name) for name, step in plan.run.checkpoints)
    if cfg.ladder.discover_all:
        for complete, _ in found.values():
            planned.update({step: planned.get(step, f"step-{step}") for step in complete})
    rows = []
    for step, name in sorted(planned.items()):
        holder = next((folder for folder in folders if step in found[folder][0]), folders[0])
        with_metrics = next((folder for folder in folders if step in found[folder][1]), None)
        rows.append({"name": name, "step": step, "tokens": step * plan.batch.batch_tokens,
                     "path": inside(holder, f"step{step}"), "exists": step in found[holder][0],
                     "metrics": with_metrics and inside(with_metrics, f"metrics_step{step}.json")})
    return rows


def read_metrics_file(path):
    """A metrics_step<N>.json a run wrote (in a folder or a bucket); a damaged one is one sentence
    naming it."""
    try:
        if "://" in path:
            from lab import remote

            fs, root = remote.filesystem(path, "ladder.alternative_dirs")
            saved = json.loads(fs.cat_file(root))
        else:
            with open(path) as f:
                saved = json.load(f)
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
        return saved
    except (OSError, ValueError) as error:
        raise UserError(f"{path} cannot be read ({error}); evaluate that checkpoint again (e.g. "
                        "`python hellaswag_eval.py`) or remove the file and its size's run folder "
                        "to retrain it.") from None


# ---------------------------------------------------------------------------- the scaling-law fit


def size_points(cfg, plan, metric="val/loss", names=("post-decay",)):
    """[(tokens, value, step)] of `metric` at the size's checkpoints whose name ends with one of
    `names` (all checkpoints for names=("",)); None when a checkpoint lacks its metrics. (ladder.py
    has checked that every size was trained as planned.)"""
    points = []
    for c in checkpoint_rows(cfg, plan):
        if not c["name"].endswith(names) or c["step"] == 0 and names != ("",):
            continue
        value = read_metrics_file(c["metrics"]).get(metric) if c["metrics"] else None
        if value is None:
            return None
        points.append((c["tokens"], value, c["step"]))
    return points


def check_losses(size, points, metric):
    for tokens, value, step in points:
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"size {size} has {metric}={value} at step {step}, which no scaling "
                            "law can fit; retrain that size from an earlier checkpoint "
                            "(checkpoint.resume_step) or drop it from ladder.sizes.")


def finished_sizes(cfg, plans, metric="val/loss"):
    """[(plan, [(tokens, value, step)])] of the sizes whose post-decay checkpoints all have
    `metric`; a sentence saying what is missing when fewer than three do (two to fit, the largest to
    check)."""
    finished, missing = [], []
    for p in plans:
        points = size_points(cfg, p, metric)
        if points is None:
            missing.append(f"{p.size} (no {metric} at some post-decay checkpoint)")
            continue
        check_losses(p.size, points, metric)
        finished.append((p, points))
    if len(finished) < 3:
        raise UserError("the fit needs three finished sizes (two to fit, the largest to check), "
                        f"and {len(finished)} are finished; missing: {'; '.join(missing)}. Train "
                        "them with run-all.")
    return finished


def fit_sizes(finished, params="non_embedding", rounds=0):
    """The law fitted to `finished` sizes' points with N counted as `params`; with `rounds`, also
    its bootstrap refits. A fit that did not converge is one sentence."""
    points = [(p.params[params], d, loss) for p, pts in finished for d, loss, _ in pts]
    law = scaling_law.fit_law(points)
    if not law["converged"]:
        raise UserError(f"the scaling-law fit did not converge ({law['message']}); check the "
                        "losses with `python ladder.py metrics`, or add sizes.")
    return law, (scaling_law.bootstrap(points, law, rounds) if rounds else [])


def fit(cfg, plans, params="non_embedding", task=None, rounds=200):
    finished = finished_sizes(cfg, plans)
    held_out, fitted = finished[-1], finished[:-1]
    law, refits = fit_sizes(fitted, params, rounds)
    n_held = held_out[0].params[params]
    bands = {name: scaling_law.interval([r[name] for r in refits])
             for name in ("E", "A", "alpha", "B", "beta")}
    ratio = scaling_law.optimal_tokens_per_param(law, n_held)
    ratio_band = scaling_law.interval([scaling_law.optimal_tokens_per_param(r, n_held)
                                       for r in refits])
    holdout = []
    for d, loss, step in held_out[1]:
        predicted = scaling_law.predict(law, n_held, d)
        holdout.append({"size": held_out[0].size, "step": step, "tokens": d, "predicted": predicted,
                        "interval": scaling_law.interval([scaling_law.predict(r, n_held, d)
                                                          for r in refits]),
                        "measured": loss, "relative_error": (predicted - loss) / loss})
    choices = {}  # the held-out error with each way of counting N (README: which predicts best)
    for choice in PARAMS:
        other = law if choice == params else fit_sizes(fitted, choice)[0]
        n_held_out = held_out[0].params[choice]
        choices[choice] = max(abs(scaling_law.predict(other, n_held_out, d) - loss) / loss
                              for d, loss, _ in held_out[1])
    result = {"params": {k: law[k] for k in ("E", "A", "alpha", "B", "beta")}, "intervals": bands,
              "n_counts": params, "bootstrap_rounds": len(refits), "holdout": holdout,
              "fitted_sizes": [p.size for p, _ in fitted], "optimal_tokens_per_param": ratio,
              "optimal_tokens_per_param_interval": ratio_band,
              "max_holdout_error_by_params": choices,
              "points": [{"size": p.size, "N": p.params[params], "tokens": d, "loss": loss,
                          "step": step}
                         for p, pts in finished for d, loss, step in pts]}
    tasks_fitted = [task] if task else cfg.ladder.fit_tasks
    result["tasks"] = {name: fit_task(cfg, finished, name, params) for name in tasks_fitted}
    os.makedirs(cfg.ladder.dir, exist_ok=True)
    with open(os.path.join(cfg.ladder.dir, "fit.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = scaling_law.plot_fit(finished, law, refits, params,
                               os.path.join(cfg.ladder.dir, "fit.png"))
    print(describe_fit(result, held_out[0], n_held))
    for name, task_fit in result["tasks"].items():
        print(describe_task(name, task_fit))
    print(f"wrote {os.path.join(cfg.ladder.dir, 'fit.json')} and {png}")


def describe_fit(result, held_out, n_held):
    p, bands = result["params"], result["intervals"]

    def with_band(name, fmt):
        low, high = bands[name]
        return f"{name} = {format(p[name], fmt)} [{format(low, fmt)}, {format(high, fmt)}]"

    fitted_points = len(result['points']) - len(result['holdout'])
    lines = [f"fit on {', '.join(result['fitted_sizes'])} ({fitted_points} post-decay points), "
             f"N = {result['n_counts']} parameters; [90% intervals from "
             f"{result['bootstrap_rounds']} bootstrap refits]",
             f"  L(N, D) = {p['E']:.3f} + {p['A']:.4g} / N^{p['alpha']:.3f} + {p['B']:.4g} / "
             f"D^{p['beta']:.3f}",
             "  " + ", ".join(with_band(name, fmt)
                              for name, fmt in (("E", ".3f"), ("alpha", ".3f"), ("beta", ".3f"))),
             f"  compute-optimal tokens per parameter at N = {n_held:,}: "
             f"{result['optimal_tokens_per_param']:.3g} "
             f"[{result['optimal_tokens_per_param_interval'][0]:.3g}, "
             f"{result['optimal_tokens_per_param_interval'][1]:.3g}]",
             f"held out, size {held_out.size}:"]
    for h in result["holdout"]:
        lines.append(f"  {h['tokens']:>12,} tokens: predicted {h['predicted']:.4f} "
                     f"[{h['interval'][0]:.4f}, {h['interval'][1]:.4f}], measured "
                     f"{h['measured']:.4f}, relative error {100 * h['relative_error']:+.2f}%")
    lines.append("largest held-out error by what N counts: " + ", ".join(
        f"{choice} {100 * error:.2f}%"
        for choice, error in result["max_holdout_error_by_params"].items()))
    return "\n".join(lines)


# -------------------------------------------------------------------- downstream tasks: two steps


def fit_task(cfg, finished, task, params):
    """OLMo's two-step prediction of a task's accuracy at the held-out size: step one, the law
    fitted to the task loss (eval/<task>/loss: the correct answer's loss per character) of the
    fitted sizes' post-decay checkpoints; step two, a sigmoid from task loss to accuracy fitted on
    every evaluated checkpoint of those sizes; chained at the held-out size's post-decay
    checkpoints."""
    metric, accuracy = f"eval/{task}/loss", f"eval/{task}/{TASKS[task].primary}"
    held_out, fitted = finished[-1], finished[:-1]
    loss_points = []
    for p, _ in finished:
        points = size_points(cfg, p, metric)
        if points is None:
            raise UserError(f"size {p.size} has no {metric} at its post-decay checkpoints; "
                            "evaluate the task there (eval.tasks in the ladder file) and train "
                            "again, or drop --task.")
        check_losses(p.size, points, metric)
        loss_points.append(points)
    pairs = [(values[metric], values[accuracy])
             for p, _ in fitted for c in checkpoint_rows(cfg, p) if c["metrics"]
             for values in [read_metrics_file(c["metrics"])]
             if metric in values and accuracy in values]
    step1 = scaling_law.fit_law([(p.params[params], d, loss)
                                 for (p, _), pts in zip(fitted, loss_points[:-1])
                                 for d, loss, _ in pts])
    accuracies = [a for _, a in pairs]
    flat = max(accuracies) - min(accuracies) < 0.02
    step2 = None if flat else scaling_law.fit_sigmoid(*zip(*pairs))
    n_held = held_out[0].params[params]
    predictions = []
    for (d, measured_loss, step), c in zip(loss_points[-1],
                                           [c for c in checkpoint_rows(cfg, held_out[0])
                                                             if c["name"].endswith("post-decay")]):
        predicted_loss = scaling_law.predict(step1, n_held, d)
        measured_accuracy = read_metrics_file(c["metrics"]).get(accuracy)
        predictions.append({"tokens": d, "step": step, "predicted_loss": predicted_loss,
                            "measured_loss": measured_loss,
                            "predicted_accuracy": (scaling_law.sigmoid(step2, predicted_loss)
                                                   if step2 else None),
                            "measured_accuracy": measured_accuracy})
    return {"accuracy_metric": accuracy,
            "step1": {k: step1[k] for k in ("E", "A", "alpha", "B", "beta")},
            "step2": step2, "accuracy_spread": max(accuracies) - min(accuracies),
            "held_out": predictions}


def describe_task(task, result):
    lines = [f"task {task} ({result['accuracy_metric']}), two steps:"]
    if result["step2"] is None:
        lines.append(f"  its accuracy moves by {result['accuracy_spread']:.3f} across every "
                     "checkpoint (chance level at these sizes): there is no sigmoid to fit, so "
                     "only the task loss is predicted")
    for h in result["held_out"]:
        line = (f"  {h['tokens']:>12,} tokens: task loss predicted {h['predicted_loss']:.4f}, "
                f"measured {h['measured_loss']:.4f}")
        if h["predicted_accuracy"] is not None:
            line += (f"; accuracy predicted {h['predicted_accuracy']:.4f}, measured "
                     f"{h['measured_accuracy']:.4f}")
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------- two ladders compared


def compare(ladder_a, ladder_b, params="non_embedding", rounds=200):
    """`ladder.py compare A B`, each ladder given as (its file, its config, its size plans): how
    many times the compute (6ND, at the same N) ladder A needs to reach the loss ladder B reaches,
    at each size, predicted at the largest size from the smaller ones (with a bootstrap interval),
    and extrapolated to a size 4x the largest. Above 1, B's recipe is better."""
    ladders = []
    for _, cfg, plans in (ladder_a, ladder_b):
        finished = finished_sizes(cfg, plans)
        ladders.append((cfg, finished, fit_sizes(finished, params)[0],
                        fit_sizes(finished[:-1], params, rounds)))
    (cfg_a, sizes_a, all_a, (small_a, refits_a)) = ladders[0]
    (cfg_b, sizes_b, all_b, (small_b, refits_b)) = ladders[1]
    config_a, config_b = ladder_a[0], ladder_b[0]
    common = [size for size in (p.size for p, _ in sizes_b) if size in {p.size for p, _ in sizes_a}]
    if len(common) < 3:
        raise UserError(f"{config_a} and {config_b} share {len(common)} finished sizes; compare "
                        "needs three or more (the same ladder.sizes, trained with run-all).")
    by_size_a, by_size_b = ({p.size: (p, pts) for p, pts in sizes} for sizes in (sizes_a, sizes_b))
    rows = []
    for size in common:
        (plan, points_b), (_, points_a) = by_size_b[size], by_size_a[size]
        n = plan.params[params]
        measured, at, d = measured_multiplier(points_a, points_b)
        rows.append({"size": size, "N": n, "tokens": d, "loss_a": points_a[-1][1],
                     "loss_b": points_b[-1][1],
                     "measured": measured, "at": at,
                     "through_laws": scaling_law.compute_multiplier(all_a, all_b, n, d, at or "b")})
    held = rows[-1]
    at = held["at"] or "b"
    predicted = scaling_law.compute_multiplier(small_a, small_b, held["N"], held["tokens"], at)
    band = scaling_law.interval([scaling_law.compute_multiplier(a, b, held["N"], held["tokens"], at)
                                 for a, b in zip(refits_a, refits_b)])
    far = 4 * held["N"]
    extrapolated = scaling_law.compute_multiplier(all_a, all_b, far, held["tokens"], at)
    # 1% of slack: the measured multiplier interpolates between checkpoints. None: nothing measured
    # to check.
    holds = None
    if held["measured"] is not None:
        holds = 0.99 * band[0] <= held["measured"] <= 1.01 * band[1]
    result = {"a": config_a, "b": config_b, "params": params, "sizes": rows,
              "held_out": {"size": held["size"], "at": at, "predicted": predicted, "interval": band,
                           "measured": held["measured"], "held": holds},
              "extrapolated": {"N": far, "tokens": held["tokens"], "multiplier": extrapolated}}
    print(f"compute multiplier: the compute A ({config_a}) needs to reach B's ({config_b}) loss, "
          "at the same N (above 1: B is better)")
    for r in rows:
        where = {"b": "at B's final loss", "a": "at A's final loss", None: "not measured"}[r["at"]]
        measured = f"{r['measured']:.3f}x" if r["measured"] is not None else "-"
        print(f"  {r['size']:<8} N {r['N']:>11,}  {r['tokens']:>12,} tokens  loss A "
              f"{r['loss_a']:.4f} B {r['loss_b']:.4f}  measured {measured} ({where})  through the "
              f"laws {r['through_laws']:.3f}x")
    if any(r["measured"] is None for r in rows):
        print("  (not measured: neither ladder's checkpoints at that size reach the other's final "
              "loss, so only the laws can say; train longer durations to measure it)")
    h = result["held_out"]
    verdict = {True: "the prediction held", False: "the prediction did not hold",
               None: "nothing measured to check"}
    measured = f"{h['measured']:.3f}x" if h["measured"] is not None else "not measured"
    print(f"  predicted at {h['size']} from the smaller sizes: {h['predicted']:.3f}x "
          f"[{h['interval'][0]:.3f}, {h['interval'][1]:.3f}]; measured {measured}: "
          f"{verdict[h['held']]}")
    print(f"  extrapolated to N = {far:,} at {held['tokens']:,} tokens: {extrapolated:.3f}x")
    out = os.path.join(cfg_b.ladder.dir, f"compare_{cfg_a.ladder.name}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


def tokens_within(points, loss):
    """The tokens at which measured post-decay (tokens, loss, step) points reach `loss`,
    interpolated in log D between the two checkpoints around it; None outside them (a measurement,
    never a law)."""
    for (d0, l0, _), (d1, l1, _) in zip(points, points[1:]):
        if l1 <= loss <= l0 and l0 != l1:
            return math.exp(math.log(d0) + (math.log(d1) - math.log(d0)) * (l0 - loss) / (l0 - l1))
    return None


def measured_multiplier(points_a, points_b):
    """(multiplier, at, tokens) at one size from the two ladders' own checkpoints. At B's final loss
    when A's checkpoints reach it (A's tokens to get there / B's); else at A's final loss when B's
    reach that (A's tokens / B's tokens to get there: the better recipe reaches the worse one's loss
    early, inside its own measurements); else (None, None, B's tokens): the gap is beyond what
    either ladder measured."""
    (d_a, loss_a, _), (d_b, loss_b, _) = points_a[-1], points_b[-1]
    reach = tokens_within(points_a, loss_b)
    if reach:
        return reach / d_b, "b", d_b
    reach = tokens_within(points_b, loss_a)
    if reach:
        return d_a / reach, "a", d_a
    return None, None, d_b
