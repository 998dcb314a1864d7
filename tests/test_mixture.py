"""Dataset mixtures: exact shares after every step, the same global batch on any world size, exact resume."""

import random

import pytest

from config import ConfigError, parse_mix
from conftest import TINY, read_metrics, run_train
from data import allocate


def test_weights_are_normalised_and_bad_entries_are_one_sentence():
    assert parse_mix(["shakespeare:3", "python:1"]) == [("shakespeare", 0.75), ("python", 0.25)]
    for bad in (["shakespeare"], ["a:0"], ["a:1", "a:2"], ["a:x"]):
        with pytest.raises(ConfigError, match="is not name:weight"):
            parse_mix(bad)


def test_every_step_keeps_each_source_within_one_sequence_of_its_share():
    rng = random.Random(0)
    for _ in range(50):
        weights = [rng.uniform(0.05, 5) for _ in range(rng.randint(2, 5))]
        shares = [w / sum(weights) for w in weights]
        per_step = rng.randint(1, 40)
        counts = start = [0] * len(shares)
        for step in range(1, 60):
            plan, new_counts = allocate(counts, start, shares, per_step)
            assert len(plan) == per_step and sum(new_counts) == step * per_step
            for source, index in plan:  # each source's stream is read in order, nothing skipped or repeated
                assert index == counts[source]
                counts = [c + (i == source) for i, c in enumerate(counts)]
            assert counts == new_counts
            assert all(abs(c - share * step * per_step) < 1 for c, share in zip(counts, shares))


def mixture_args(root, out, *extra):
    return TINY + [f"--data.data_root={root}", f"--train.out_dir={out}", "--data.mix=shakespeare:3,python:1",
                   "--train.total_batch_size=256", "--eval.interval=2", *extra]


def test_a_mixture_on_two_gloo_ranks_matches_one_rank_with_accumulation(mixture_root, tmp_path):
    run_train(mixture_args(mixture_root, tmp_path / "one", "--train.max_steps=4"))
    run_train(mixture_args(mixture_root, tmp_path / "two", "--train.max_steps=4"), nproc=2)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]  # zip ends at the shorter run
    for a, b in zip(one, two):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["data/python/sequences"] == b["data/python/sequences"]
        if "val/loss" in a:
            assert a["val/python/loss"] == pytest.approx(b["val/python/loss"], rel=1e-5)


def test_mixture_metrics_shares_and_validation(mixture_root, tmp_path):
    result = run_train(mixture_args(mixture_root, tmp_path, "--train.max_steps=4"))
    assert "data: shakespeare 75.0%, python 25.0%" in result.stdout
    rows = read_metrics(tmp_path)
    for step, row in enumerate(rows, 1):  # 8 sequences per step: exactly 6 and 2
        assert (row["data/shakespeare/sequences"], row["data/python/sequences"]) == (6 * step, 2 * step)
    last = rows[-1]
    assert last["val/loss"] == pytest.approx(0.75 * last["val/shakespeare/loss"] + 0.25 * last["val/python/loss"])


def test_a_mixture_resumes_bit_exactly_and_cannot_change_on_resume(mixture_root, tmp_path):
    run_train(mixture_args(mixture_root, tmp_path / "full", "--train.max_steps=8", "--model.dropout=0.1"))
    run_train(mixture_args(mixture_root, tmp_path / "split", "--train.max_steps=8", "--model.dropout=0.1",
                           "--train.hard_stop=3"))
    changed = run_train(mixture_args(mixture_root, tmp_path / "split", "--train.max_steps=8", "--model.dropout=0.1",
                                     "--data.mix=shakespeare:1,python:1"), check=False)
    assert changed.returncode != 0 and "this run has data.mix=" in changed.stderr
    run_train(mixture_args(mixture_root, tmp_path / "split", "--train.max_steps=8", "--model.dropout=0.1"))
    full, split = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in split] == list(range(1, 9))
    for a, b in zip(full, split):
        assert a["train/loss"] == b["train/loss"] and a["data/python/sequences"] == b["data/python/sequences"]
