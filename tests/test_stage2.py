"""Two-stage training with a KL penalty: beta = 0 equals a run that only switches data, resuming inside
stage 2 is exact, the estimators compute what they claim, and the stage boundary is kept."""

import pytest
import torch
from torch.nn import functional as F

from lab import stage2
import train
from checkpoint import find_checkpoints, read_marker
from config import ConfigError, parse_args
from conftest import TINY, read_metrics, run_train
from lab.stage2 import full_kl


def stage2_args(root, out, *extra):
    return TINY + [f"--data.data_root={root}", f"--train.out_dir={out}", "--train.max_steps=8", "--eval.interval=4",
                   "--model.dropout=0.1", "--stage2.start=4steps", "--stage2.mix=python:1", *extra]


def test_beta_zero_trains_bit_for_bit_like_a_run_that_only_switches_data(mixture_root, tmp_path, monkeypatch):
    run_train(stage2_args(mixture_root, tmp_path / "kl", "--stage2.kl_beta=0"))
    # The run that only switches data: stage 2's data from the same step, but no reference built and no KL
    # term. Patched where the loop gets them (Stages.for_step, and the make_reference it calls); monkeypatch
    # raises if either name is gone, so the patch cannot silently leave the same run as above.
    stage_at = train.Stages.for_step
    monkeypatch.setattr(train.Stages, "for_step", lambda self, step: (*stage_at(self, step)[:2], None))
    monkeypatch.setattr(stage2, "make_reference", lambda *args, **kwargs: "no reference built")
    run_train(stage2_args(mixture_root, tmp_path / "switch"))  # in this process, as the run above
    kl, switch = read_metrics(tmp_path / "kl"), read_metrics(tmp_path / "switch")
    assert [r["step"] for r in switch] == [r["step"] for r in kl] == list(range(1, 9))
    assert not any("train/kl" in r for r in switch)  # the patch took: this run had no KL term at all
    assert [r["train/loss"] for r in switch[:4]] == [r["train/loss"] for r in kl[:4]]
    # Dropout on: the reference (eval mode, no_grad) draws no random numbers, so the masks stay the same.
    assert [r["train/loss"] for r in switch[4:]] == [r["train/ce_loss"] for r in kl[4:]]
    assert [r["train/loss"] for r in kl[4:]] == [r["train/ce_loss"] for r in kl[4:]]  # beta = 0 adds exactly 0
    assert all("train/kl" in r and "train/reference_loss" in r for r in kl[4:]) and "train/kl" not in kl[3]
    assert kl[-1]["data/python/sequences"] == switch[-1]["data/python/sequences"] == 4 * 4  # 4 steps of 4


def test_a_run_stopped_inside_stage_2_resumes_bit_exactly(mixture_root, tmp_path):
    common = ["--stage2.kl_beta=0.5"]
    run_train(stage2_args(mixture_root, tmp_path / "full", *common))
    run_train(stage2_args(mixture_root, tmp_path / "split", *common, "--train.hard_stop=6"))
    resumed = run_train(stage2_args(mixture_root, tmp_path / "split", *common))
    assert "at step 6" in resumed.stdout
    full, split = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in split] == list(range(1, 9))
    for a, b in zip(full, split):
        assert a["train/loss"] == b["train/loss"] and a.get("train/kl") == b.get("train/kl")
    boundary = dict(find_checkpoints(tmp_path / "split"))[4]  # the stage boundary is a fixed checkpoint
    assert read_marker(boundary)["kind"] == "fixed"


def test_the_objective_is_ce_plus_beta_kl_and_the_full_estimator_is_the_exact_kl(mixture_root, tmp_path):
    run_train(stage2_args(mixture_root, tmp_path / "run", "--stage2.kl_beta=2", "--stage2.kl_estimator=full"))
    for row in read_metrics(tmp_path / "run")[4:]:
        assert row["train/loss"] == pytest.approx(row["train/ce_loss"] + 2 * row["train/kl"], rel=1e-6)
        assert row["train/kl"] >= 0
    torch.manual_seed(0)
    logits, reference, targets = torch.randn(2, 5, 50304), torch.randn(2, 5, 50304), torch.randint(0, 50257, (2, 5))
    targets[0, 0] = -1  # not scored
    log_p = F.log_softmax(logits[..., :50257], -1)
    log_q = F.log_softmax(reference[..., :50257], -1)
    expected = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)[targets != -1].mean()
    assert full_kl(logits, reference, targets) == pytest.approx(expected.item(), rel=1e-5)


def test_stage_2_settings_need_a_start_and_a_start_before_the_end(mixture_root, tmp_path):
    with pytest.raises(ConfigError, match="need stage2.start"):
        parse_args(["--stage2.kl_beta=0.1"])
    result = run_train(stage2_args(mixture_root, tmp_path / "run", "--stage2.start=8steps"), check=False)
    assert result.returncode != 0 and "not before the run's end at step 8" in result.stderr


def test_the_dry_run_shows_the_stage_boundary(mixture_root, tmp_path):
    result = run_train(stage2_args(mixture_root, tmp_path / "run", "--stage2.kl_beta=0.1", "--dry_run"))
    assert "stage 2: after step 4 (512 tokens): data python 100.0%; CE + 0.1 x KL (nll_diff)" in result.stdout
    assert "checkpoints at 2 step(s): 4, 8" in result.stdout and not (tmp_path / "run").exists()


def test_a_reference_from_another_source_is_used_as_given(mixture_root, tmp_path):
    run_train(
        TINY + [f"--data.data_root={mixture_root}", f"--train.out_dir={tmp_path / 'other'}", "--train.max_steps=2"]
    )
    run_train(stage2_args(mixture_root, tmp_path / "snapshot", "--stage2.kl_beta=0.5"))
    run_train(stage2_args(mixture_root, tmp_path / "given", "--stage2.kl_beta=0.5",
                          f"--stage2.reference={tmp_path / 'other'}"))
    snapshot, given = read_metrics(tmp_path / "snapshot"), read_metrics(tmp_path / "given")
    assert snapshot[4]["train/ce_loss"] == given[4]["train/ce_loss"]  # the same model at the first stage-2 step
    assert snapshot[4]["train/reference_loss"] != given[4]["train/reference_loss"]  # but another reference


def test_a_reference_that_cannot_serve_this_run_is_refused_before_stage_1_trains(mixture_root, tmp_path):
    """Checked at start, not when stage 2 begins (a traceback then, hours in): a reference trained on shorter
    sequences, and one whose weights do not fit its own class as the code is now."""
    from conftest import assert_one_sentence

    short = tmp_path / "short"
    run_train(TINY + [f"--data.data_root={mixture_root}", f"--train.out_dir={short}", "--train.max_steps=2",
                      "--model.block_size=16", "--train.total_batch_size=64", "--eval.interval=0"])
    refused = run_train(stage2_args(mixture_root, tmp_path / "run", "--stage2.kl_beta=0.1",
                                    f"--stage2.reference={short}"), check=False)
    assert_one_sentence(refused, f"stage2.reference={short} reads 16 tokens at most and predicts 50304, and this "
                                 f"run's model.block_size is 32")
    state = torch.load(short / "step2" / "model.pt", weights_only=True)
    state["transformer.h.0.gain"] = torch.ones(32)  # saved by a fork this code is not
    torch.save(state, short / "step2" / "model.pt")
    import json
    from checkpoint import sha256_file
    marker = json.loads((short / "step2" / "COMPLETE").read_text())
    marker["files"]["model.pt"] = sha256_file(short / "step2" / "model.pt")
    (short / "step2" / "COMPLETE").write_text(json.dumps(marker))
    refused = run_train(stage2_args(mixture_root, tmp_path / "run", "--stage2.kl_beta=0.1", "--model.block_size=16",
                                    "--train.total_batch_size=64", f"--stage2.reference={short}"), check=False)
    assert_one_sentence(refused, "do not fit this model: it has transformer.h.0.gain, which this model has not")
    assert not (tmp_path / "run").exists()
