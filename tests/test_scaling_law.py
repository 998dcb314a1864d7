"""The ladder's fits (scaling_law.py) on points made from known laws, and ladder.py's fit and compare
on ladder folders written from known laws (no training: the numbers are the test)."""

import json
import math

import numpy as np
import pytest

from lab import scaling_law
from conftest import run_ladder

TRUTH = {"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28}


def test_the_fit_recovers_a_known_law_and_says_it_converged():
    points = [(n, d, scaling_law.predict(TRUTH, n, d)) for n in (1e6, 4e6, 16e6) for d in (2e7, 8e7, 3.2e8)]
    fitted = scaling_law.fit_law(points)
    assert fitted["converged"]
    for n, d in ((64e6, 1.28e9), (64e6, 5e9)):  # a size 4x beyond the fitted ones
        assert math.isclose(scaling_law.predict(fitted, n, d), scaling_law.predict(TRUTH, n, d), rel_tol=1e-4)


def test_bootstrap_intervals_cover_the_truth_on_noisy_points():
    rng = np.random.default_rng(1)
    points = [(n, d, scaling_law.predict(TRUTH, n, d) * math.exp(rng.normal(0, 0.003)))
              for n in (1e6, 2e6, 4e6, 8e6) for d in (2e7, 4e7, 8e7, 1.6e8)]
    fitted = scaling_law.fit_law(points)
    refits = scaling_law.bootstrap(points, fitted, rounds=60)
    assert len(refits) >= 50
    n, d = 32e6, 3.2e8  # 4x past the largest size
    low, high = scaling_law.interval([scaling_law.predict(r, n, d) for r in refits])
    assert low < scaling_law.predict(TRUTH, n, d) < high and high - low < 0.1  # within about 1%
    assert low <= scaling_law.predict(fitted, n, d) <= high


def test_a_law_that_needs_k_times_the_data_costs_k_times_the_compute():
    k = 2.5
    slower = {**TRUTH, "B": TRUTH["B"] * k ** TRUTH["beta"]}  # slower(N, kD) == TRUTH(N, D)
    for n, d in ((1e6, 2e7), (1e8, 2e9)):
        assert math.isclose(scaling_law.compute_multiplier(slower, TRUTH, n, d), k, rel_tol=1e-9)
        assert math.isclose(scaling_law.compute_multiplier(TRUTH, slower, n, d), 1 / k, rel_tol=1e-9)
        # Asked at A's loss instead of B's: the same k for a law that differs by a constant factor in D.
        assert math.isclose(scaling_law.compute_multiplier(slower, TRUTH, n, d, at="a"), k, rel_tol=1e-9)
    unreachable = {**TRUTH, "E": 9.5}  # above TRUTH's loss there (9.03)
    assert scaling_law.compute_multiplier(unreachable, TRUTH, 1e6, 2e7) == math.inf
    assert scaling_law.compute_multiplier(TRUTH, unreachable, 1e6, 2e7, at="a") == 0


def test_two_steps_predict_a_held_out_accuracy_from_a_known_two_step_law():
    """Step one: task loss follows a law in (N, D); step two: accuracy is a sigmoid of the task loss."""
    law = {"E": 0.9, "A": 60.0, "alpha": 0.3, "B": 90.0, "beta": 0.3}
    curve = {"floor": 0.25, "top": 0.9, "k": 6.0, "loss_mid": 1.6}
    fitted_sizes, held = (2e6, 6e6, 2e7, 6e7), 2e8
    runs = [(n, d) for n in fitted_sizes for d in np.geomspace(1e8, 4e9, 6)]
    step1 = scaling_law.fit_law([(n, d, scaling_law.predict(law, n, d)) for n, d in runs])
    losses = [scaling_law.predict(law, n, d) for n, d in runs]
    step2 = scaling_law.fit_sigmoid(losses, [scaling_law.sigmoid(curve, x) for x in losses])
    for d in (1e9, 4e9):
        predicted = scaling_law.sigmoid(step2, scaling_law.predict(step1, held, d))
        assert predicted == pytest.approx(scaling_law.sigmoid(curve, scaling_law.predict(law, held, d)), abs=2e-3)


# ----------------------------------------------------------------------------- ladder.py on folders written from a law


def write_ladder(tmp_path, name, law, extra="", corrupt=None, finished=False, task=None):
    """A ladder file and, for each size, the config.json and metrics_step<N>.json files run-all would
    leave, with val/loss from `law` (N = non-embedding parameters, D = tokens); with `finished`, also a
    complete final checkpoint folder (its marker); with `task` = (name, task law, sigmoid), also that task's
    loss (from the task law) and accuracy (the sigmoid of the loss) at every checkpoint."""
    import ladder

    path = tmp_path / f"{name}.py"
    path.write_text(f'ladder.name = "{name}"\nladder.dir = "{tmp_path / name}"\n'
                    f'ladder.sizes = ["1x32", "2x32", "2x64", "4x64"]\nladder.batch_tokens = 512\n'
                    f'ladder.duration_tokens = 102400\nladder.warmup_tokens = 5120\nladder.chinchilla_multiple = 2\n'
                    f'model.block_size = 64\n{extra}')
    cfg = ladder.read_config(str(path), [])
    for plan in ladder.plan_sizes(cfg):
        folder = tmp_path / name / plan.size
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(ladder.config_to_dict(ladder.run_config(cfg, plan))))
        for checkpoint, step in plan.run.checkpoints:
            tokens = step * plan.batch.batch_tokens
            loss = scaling_law.predict(law, plan.non_embedding_params, tokens) if step else 10.8
            if corrupt and (plan.size, checkpoint) == corrupt[:2]:
                loss = corrupt[2]
            values = {"step": step, "val/loss": loss}
            if task:
                name_, task_law, curve = task
                task_loss = scaling_law.predict(task_law, plan.non_embedding_params, max(tokens, 512))
                values.update(
                    {f"eval/{name_}/loss": task_loss, f"eval/{name_}/acc": scaling_law.sigmoid(curve, task_loss)}
                )
            (folder / f"metrics_step{step}.json").write_text(json.dumps(values))
        if finished:
            final = folder / f"step{plan.run.max_steps}"
            final.mkdir()
            (final / "COMPLETE").write_text(json.dumps({"step": plan.run.max_steps, "kind": "fixed", "files": {}}))
    return str(path)


LAW = {"E": 3.0, "A": 40.0, "alpha": 0.35, "B": 300.0, "beta": 0.3}


def test_fit_reports_intervals_and_predicts_a_held_out_size_drawn_from_the_law(tmp_path):
    path = write_ladder(tmp_path, "a", LAW)
    result = run_ladder("fit", path, "--rounds=20")
    assert result.returncode == 0, result.stderr
    fit = json.loads((tmp_path / "a" / "fit.json").read_text())
    assert fit["fitted_sizes"] == ["1x32", "2x32", "2x64"] and fit["n_counts"] == "non_embedding"
    assert all(abs(h["relative_error"]) < 1e-3 for h in fit["holdout"])
    # Points exactly on the law: the bootstrap's interval is a few 1e-11 wide, and rounding may put the prediction
    # a hair outside it; it must bracket the prediction to within 1e-9 of the value.
    assert all(h["interval"][0] - 1e-9 * h["predicted"] <= h["predicted"] <= h["interval"][1] + 1e-9 * h["predicted"]
               for h in fit["holdout"])
    assert set(fit["intervals"]) == {"E", "A", "alpha", "B", "beta"}
    assert set(fit["max_holdout_error_by_params"]) == {"non_embedding", "with_output", "total"}
    assert "held out, size 4x64" in result.stdout and "largest held-out error by what N counts" in result.stdout
    assert (tmp_path / "a" / "fit.png").stat().st_size > 0


def test_fit_refuses_a_loss_that_cannot_be_fitted_naming_size_and_step(tmp_path):
    path = write_ladder(tmp_path, "a", LAW, corrupt=("2x32", "1xD-post-decay", float("nan")))
    result = run_ladder("fit", path)
    assert result.returncode == 1 and "size 2x32 has val/loss=nan at step 200" in result.stderr
    assert not (tmp_path / "a" / "fit.json").exists()


def test_fit_refuses_sizes_trained_under_other_settings(tmp_path):
    path = write_ladder(tmp_path, "a", LAW)
    result = run_ladder("fit", path, "--ladder.lr_multiplier=2")
    assert result.returncode == 1 and "was trained under other settings (optim.lr=" in result.stderr
    assert not (tmp_path / "a" / "fit.json").exists()


def test_compare_reports_the_compute_multiplier_between_two_ladders(tmp_path):
    k = 2.0  # ladder a needs twice the data of ladder b for the same loss
    slow = write_ladder(tmp_path, "slow", {**LAW, "B": LAW["B"] * k ** LAW["beta"]})
    fast = write_ladder(tmp_path, "fast", LAW)
    result = run_ladder("compare", slow, fast, "--rounds=20")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "fast" / "compare_slow.json").read_text())
    assert [r["size"] for r in report["sizes"]] == ["1x32", "2x32", "2x64", "4x64"]
    # B's final loss lies beyond A's checkpoints (A would need 4x D), so the measured multiplier is taken
    # at A's final loss, which B's checkpoints reach: from the measurements alone, never from a law.
    assert all(r["measured"] == pytest.approx(k, rel=1e-2) and r["at"] == "a" for r in report["sizes"])
    assert report["held_out"]["predicted"] == pytest.approx(k, rel=1e-3) and report["held_out"]["held"]
    assert report["extrapolated"]["multiplier"] == pytest.approx(k, rel=1e-3)
    assert "the prediction held" in result.stdout
    far = write_ladder(tmp_path, "far", {**LAW, "B": LAW["B"] * 10 ** LAW["beta"]})  # 10x: beyond both ladders
    beyond = run_ladder("compare", far, fast, "--rounds=5")
    assert beyond.returncode == 0, beyond.stderr
    report = json.loads((tmp_path / "fast" / "compare_far.json").read_text())
    assert all(r["measured"] is None for r in report["sizes"]) and report["held_out"]["held"] is None
    assert "nothing measured to check" in beyond.stdout and "train longer durations" in beyond.stdout
    wrong = run_ladder("compare", slow)
    assert wrong.returncode == 1 and "compare takes two ladder files" in wrong.stderr


def test_fit_predicts_a_tasks_accuracy_in_two_steps_and_says_when_it_sits_at_chance(tmp_path):
    task_law = {"E": 0.5, "A": 8.0, "alpha": 0.3, "B": 40.0, "beta": 0.3}
    curve = {"floor": 0.5, "top": 0.95, "k": 6.0, "loss_mid": 2.1}  # task losses run from 1.7 to 2.5
    path = write_ladder(tmp_path, "a", LAW, extra='eval.tasks = ["copa"]\n', task=("copa", task_law, curve))
    result = run_ladder("fit", path, "--task=copa", "--rounds=5")
    assert result.returncode == 0, result.stderr
    held = json.loads((tmp_path / "a" / "fit.json").read_text())["tasks"]["copa"]["held_out"]
    # Every post-decay checkpoint of the held-out size (ladder_fit pairs them with a zip, which an empty
    # or short side ends silently): the loop below then checks each prediction, never none.
    assert [h["step"] for h in held] == [100, 200, 400]
    for h in held:
        assert h["predicted_loss"] == pytest.approx(h["measured_loss"], rel=1e-3)
        assert h["predicted_accuracy"] == pytest.approx(h["measured_accuracy"], abs=0.01)
    assert "task copa (eval/copa/acc), two steps:" in result.stdout
    flat = write_ladder(tmp_path, "b", LAW, extra='eval.tasks = ["copa"]\n',
                        task=("copa", task_law, {**curve, "top": 0.505}))  # accuracy never leaves chance
    at_chance = run_ladder("fit", flat, "--task=copa", "--rounds=5")
    assert at_chance.returncode == 0 and "there is no sigmoid to fit" in at_chance.stdout
    missing = run_ladder("fit", path, "--task=piqa")
    assert missing.returncode == 1 and "--task=piqa is not among eval.tasks" in missing.stderr
