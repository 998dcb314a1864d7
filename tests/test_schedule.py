"""Each LR schedule against a table computed by hand from the issue's formulas, boundaries included,
and the dry run, which must leave the run folder untouched."""

import math
import re

import pytest

from config import Config, ConfigError, OptimConfig, parse_args
import warm_python
from conftest import ROOT, TINY, read_metrics, run_train
from optimizer import build_schedule
from optimizer import period_ends


def lrs(total_steps, **optim):
    schedule = build_schedule(OptimConfig(**{"lr": 1.0, "min_lr": 0.1, "warmup_steps": 0, **optim}), total_steps)
    return [round(schedule.lr_at(n), 6) for n in range(1, total_steps + 1)]


# T = 10, W = 2, D = 4: warmup 1/2, 2/2; stable through n = 6 = T - D (s(1) = 1); then the decay.
WSD_TABLES = {
    "linear": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1],  # 0.1 + 0.9 * (T - n) / 4
    "cosine": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.868198, 0.55, 0.231802, 0.1],  # (1 - cos(pi x)) / 2
    "1-sqrt": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.55, 0.363604, 0.220577, 0.1],  # 1 - sqrt(1 - x)
}


@pytest.mark.parametrize("shape", list(WSD_TABLES))
def test_wsd_matches_the_hand_table(shape):
    assert lrs(10, schedule="wsd", warmup_steps=2, decay_steps=4, decay_shape=shape) == WSD_TABLES[shape]


def test_wsd_takes_warmup_and_decay_as_fractions_of_the_run():
    assert lrs(10, schedule="wsd", warmup_fraction=0.2, decay_fraction=0.4) == WSD_TABLES["linear"]


def test_wsds_periods_decay_to_the_floor_and_jump_back_to_their_peak():
    # Periods of 4 steps with peaks 1 and 0.5, min_lr 0, warmup 1, decay 2 per period: in each period
    # m = 1..4, the decay runs over m >= 4 - 2 with x = (4 - m) / 2.
    schedule = build_schedule(OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=1, schedule="wsds", periods=[4, 4],
                                          period_lr_multipliers=[1.0, 0.5], decay_steps=2), 8)
    assert [schedule.lr_at(n) for n in range(1, 9)] == [1.0, 1.0, 0.5, 0.0, 0.5, 0.5, 0.25, 0.0]
    assert period_ends(schedule) == [4, 8]


def test_wsds_decay_fraction_is_of_each_period():
    schedule = build_schedule(OptimConfig(schedule="wsds", periods=[10, 20], warmup_steps=2), 30)
    assert schedule.decay_steps == (1, 2)


def test_wsds_warmup_plus_first_decay_longer_than_the_first_period_names_both():
    with pytest.raises(ConfigError, match=r"warmup \(3 steps\) plus the first decay \(2 steps\) is longer than the "
                                          r"first period \(4 steps\)"):
        build_schedule(OptimConfig(schedule="wsds", periods=[4, 4], warmup_steps=3, decay_steps=2), 8)


@pytest.mark.parametrize("periods, steps", [([100, 100], 50), ([10, 10], 50)])
def test_wsds_periods_must_add_up_to_the_run(periods, steps):
    """Too long, the last periods never happen; too short, the run idles at the floor after them."""
    with pytest.raises(ConfigError, match=f"add up to {sum(periods)} steps but the run is {steps} steps"):
        build_schedule(OptimConfig(schedule="wsds", periods=periods, warmup_steps=1), steps)


@pytest.mark.parametrize("override, message", [
    ("--optim.periods=10,10", "belong to optim.schedule=wsds, and this run's schedule is wsd"),
    ("--optim.period_lr_multipliers=1,inf", "optim.period_lr_multipliers must be positive numbers (got [1.0, inf])"),
])
def test_period_settings_are_refused_where_they_mean_nothing(override, message):
    extra = ["--optim.schedule=wsds", "--optim.periods=10,10"] if "multipliers" in override else []
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args([*extra, override])


def test_linear_and_constant_schedules():
    assert lrs(6, schedule="linear", warmup_steps=2) == [0.5, 1.0, 0.775, 0.55, 0.325, 0.1]
    assert lrs(4, schedule="constant", warmup_steps=2) == [0.5, 1.0, 1.0, 1.0]


def test_cosine_is_todays_schedule_unchanged():
    o = OptimConfig(lr=6e-4, min_lr=6e-5, warmup_steps=5)
    schedule = build_schedule(o, 50)
    for step in range(60):  # step: 0-based, as the loop counted before schedule.py
        if step < o.warmup_steps:
            old = o.lr * (step + 1) / o.warmup_steps
        else:
            progress = min(1.0, (step - o.warmup_steps) / max(1, 50 - o.warmup_steps))
            old = o.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (o.lr - o.min_lr)
        assert schedule.lr_at(step + 1) == old


def test_only_one_of_warmup_steps_and_warmup_fraction():
    with pytest.raises(ConfigError, match="optim.warmup_steps=30 and optim.warmup_fraction=0.1 are both set"):
        parse_args(["--optim.warmup_fraction=0.1"])
    assert parse_args(["--optim.warmup_fraction=0.1", "--optim.warmup_steps=0"]).optim.warmup_fraction == 0.1


def test_logged_lr_follows_the_schedule_in_a_run(data_root, tmp_path):
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=10",
                      "--optim.schedule=wsd", "--optim.warmup_steps=2", "--optim.decay_steps=4", "--optim.lr=1.0",
                      "--optim.min_lr=0.1", "--eval.interval=0", "--optim.grad_clip=1"])
    assert [round(r["optim/lr"], 6) for r in read_metrics(tmp_path)] == WSD_TABLES["linear"]


def test_dry_run_prints_the_plan_and_leaves_the_folder_untouched(data_root, tmp_path):
    out = tmp_path / "run"
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=40",
                               "--optim.schedule=wsds", "--optim.periods=10,10,20", "--checkpoint.interval=10",
                               "--train.total_batch_size=256", "--dry_run"], env={"WORLD_SIZE": "2"})
    assert not out.exists()
    assert "2 rank(s)" in result.stdout and "micro-step(s)" in result.stdout
    assert "periods [10, 10, 20] ending at steps [10, 20, 40]" in result.stdout
    assert "checkpoints at 4 step(s): 10, 20, 30, 40" in result.stdout
    plot = result.stdout.split("learning rate plot: ")[1].strip()
    assert open(plot, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_dry_run_fails_on_a_config_error_as_a_real_run_would(tmp_path):
    result = warm_python.python(["train.py", "--optim.lr=-1", "--dry_run"], ROOT)
    assert result.returncode != 0
    assert result.stderr.strip() == "error: optim.lr must be greater than 0 (got -1.0); set it to a value in range."
    assert Config().optim.schedule == "cosine"  # the default run is unchanged
