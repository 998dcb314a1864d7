import json
import math
import subprocess
import sys

import pytest
import torch

from metrics import LossSpikeDetector
from config import ConfigError, duration_to_steps, parse_args, parse_step_ranges
from conftest import ROOT, TINY, read_metrics, run_train
from metrics import MetricRecorder
from model import GPT, GPTConfig


def test_each_reduction_across_two_gloo_ranks(tmp_path):
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(ROOT / "tests" / "reduce_metrics_on_two_ranks.py"), str(out)], check=True, timeout=120)
    (step1, first), (step2, second) = json.loads(out.read_text())
    assert step1 == 1 and step2 == 2
    assert first["test/mean"] == 1.5 and first["test/sum"] == 3.0 and first["test/max"] == 2.0
    assert first["test/l2_norm"] == pytest.approx(math.sqrt(1 + 4))
    assert first["test/rank0"] == 1.0
    assert second == {"test/mean": 15.0}


# OLMo-core's MetricMergeStrategy: mean averages the new value with the stored one, pair by pair.
@pytest.mark.parametrize("merge,expected", [("latest", 3.0), ("oldest", 1.0), ("mean", 2.25), ("sum", 6.0),
                                            ("max", 3.0), ("min", 1.0)])
def test_merge_rules_for_a_metric_recorded_twice_in_a_step(merge, expected):
    recorder = MetricRecorder("cpu")
    for value in (1.0, 2.0, 3.0):
        recorder.record_metric("x", torch.tensor(value), merge=merge)
    recorder.finish_step(1, write=False)
    assert recorder.collect() == [(1, {"x": expected})]


def test_default_merge_warns_every_time_and_keeps_the_value_already_recorded():
    recorder = MetricRecorder("cpu")
    recorder.record_metric("x", 1.0)
    for value in (2.0, 3.0):
        with pytest.warns(UserWarning, match="recorded twice"):
            recorder.record_metric("x", value)
    recorder.finish_step(1, write=False)
    assert recorder.collect() == [(1, {"x": 1.0})]


def test_a_metric_recorded_with_another_reduce_type_is_an_error():
    recorder = MetricRecorder("cpu")
    recorder.record_metric("x", 1.0, reduce="sum")
    recorder.finish_step(1, write=False)
    with pytest.raises(ValueError, match="must keep one reduce type"):
        recorder.record_metric("x", 1.0, reduce="max")


def test_large_counts_survive_collection_exactly():
    recorder = MetricRecorder("cpu")
    recorder.record_metric("tokens", 10_000_000_001)
    recorder.finish_step(1, write=False)
    assert recorder.collect()[0][1]["tokens"] == 10_000_000_001


def base(data_root, out, *extra):
    return TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", *extra]


DETERMINISTIC = ("train/loss", "train/grad_norm", "optim/lr", "val/loss", "tokens")


def test_collect_interval_logs_the_same_values_as_collecting_every_step(data_root, tmp_path):
    run_train(base(data_root, tmp_path / "every", "--train.max_steps=8", "--eval.interval=4",
                   "--log.metrics_collect_interval=1"))
    run_train(base(data_root, tmp_path / "batched", "--train.max_steps=8", "--eval.interval=4",
                   "--log.metrics_collect_interval=5"))
    every, batched = read_metrics(tmp_path / "every"), read_metrics(tmp_path / "batched")
    assert [r["step"] for r in batched] == list(range(1, 9))
    for a, b in zip(every, batched):
        assert {k: a.get(k) for k in DETERMINISTIC} == {k: b.get(k) for k in DETERMINISTIC}


def test_async_bookkeeping_on_two_ranks_logs_the_same_values(data_root, tmp_path):
    common = [
        "--train.max_steps=8",
        "--eval.interval=4",
        "--train.total_batch_size=256",
        "--log.metrics_collect_interval=3",
    ]
    run_train(base(data_root, tmp_path / "sync", *common))
    run_train(base(data_root, tmp_path / "async", *common, "--log.async_bookkeeping=true",
                   "--checkpoint.interval=5"), nproc=2)
    sync, threaded = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "async")
    assert [r["step"] for r in threaded] == list(range(1, 9))
    for a, b in zip(sync, threaded):
        # The checkpoint at step 5 adds a collection there (memory is sampled at collections) and its time to
        # step 6's row.
        def same_keys(row):
            return {k for k in row if not k.startswith("system/") and k != "throughput/checkpoint_time_sec"}
        assert same_keys(a) == same_keys(b)
        for key in DETERMINISTIC:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), key
    assert threaded[-1]["tokens"] == 8 * 256 and isinstance(threaded[-1]["tokens"], int)


def test_monitors_write_their_metrics_snapshots_environment_and_profile(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(base(data_root, out, "--train.max_steps=8", "--eval.interval=4", "--log.grad_norms_interval=2",
                   "--log.profile=true", "--log.profile_wait=1", "--log.profile_warmup=1", "--log.profile_active=2"))
    rows = read_metrics(out)
    for key in ["throughput/tokens_per_sec", "throughput/sequences_per_sec", "throughput/step_time_sec",
                "throughput/data_time_sec", "throughput/total_petaflops", "system/cpu_rss_gb"]:
        assert key in rows[-1], key
    assert rows[-1]["throughput/total_petaflops"] == pytest.approx(
        GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)).flops_per_token() * 8 * 128 / 1e15)
    assert {"grad/embedding", "grad/layer00", "grad/layer01"} <= set(rows[1]) and "grad/layer00" not in rows[0]
    assert json.loads((out / "metrics_step4.json").read_text())["val/loss"] == rows[3]["val/loss"]
    assert (out / "metrics_step8.json").exists() and not (out / "metrics_step5.json").exists()
    env = json.loads((out / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and "git_commit" in env
    traces = list((out / "profiler").glob("*.json*"))
    assert traces and traces[0].stat().st_size > 0


def test_extra_validation_sets_are_evaluated_at_interval_and_fixed_steps(data_root, tmp_path):
    from prepare_data import prepare_text

    (tmp_path / "poem.txt").write_text("Shall I compare thee to a summer's day?\n" * 400)
    prepare_text(str(tmp_path / "root" / "sonnets"), [str(tmp_path / "poem.txt")], 10_000, 0.5, workers=1)
    (tmp_path / "root" / "shakespeare").symlink_to(data_root / "shakespeare")
    out = tmp_path / "run"
    run_train(TINY + [f"--data.data_root={tmp_path / 'root'}", f"--train.out_dir={out}", "--train.max_steps=6",
                      "--eval.interval=4", "--eval.fixed_steps=1", "--eval.extra_datasets=sonnets"])
    evaluated = {r["step"]: r for r in read_metrics(out) if "val/loss" in r}
    assert sorted(evaluated) == [1, 4, 6]
    assert all("val/sonnets/loss" in r for r in evaluated.values())
    assert evaluated[6]["val/sonnets/loss"] != evaluated[6]["val/loss"]


def test_wandb_offline_run_holds_the_logged_keys(data_root, tmp_path):
    out = tmp_path / "run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run_train(base(data_root, out, "--train.max_steps=3", "--log.wandb=true", "--train.hard_stop=2"), env=env)
    run_id = (out / "wandb_id.txt").read_text()
    run_train(base(data_root, out, "--train.max_steps=3", "--log.wandb=true"), env=env)  # resumes the same W&B run
    assert (out / "wandb_id.txt").read_text() == run_id
    run_dirs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(run_dirs) == 2  # one per process, both the same W&B run id
    data = (run_dirs[-1] / f"run-{run_id}.wandb").read_bytes()
    for key in [b"train/loss", b"optim/lr", b"throughput/tokens_per_sec"]:
        assert key in data


@pytest.mark.parametrize("async_bookkeeping", ["false", "true"])
def test_nan_loss_stops_the_run_with_a_clear_message(data_root, tmp_path, async_bookkeeping):
    # An absurd learning rate overflows the weights after the first update, so step 2's loss is NaN.
    result = run_train(base(data_root, tmp_path, "--train.max_steps=6", "--optim.lr=1e20", "--optim.grad_clip=0",
                            "--eval.interval=0", "--log.metrics_collect_interval=2",
                            f"--log.async_bookkeeping={async_bookkeeping}"), check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "train/loss is nan at step 2" in result.stderr and "train.nan_policy=skip" in result.stderr
    assert not list(tmp_path.glob("step*"))  # nothing garbage was checkpointed


def test_nan_policy_skip_skips_the_bad_steps_and_keeps_finite_weights(data_root, tmp_path):
    run_train(base(data_root, tmp_path, "--train.max_steps=4", "--optim.lr=1e20", "--optim.grad_clip=0",
                   "--eval.interval=0", "--train.nan_policy=skip"))
    rows = read_metrics(tmp_path)
    assert "train/loss" in rows[0] and all("train/loss" not in r for r in rows[1:])
    assert all(r["train/skipped_nonfinite_step"] == 1.0 for r in rows[1:])
    weights = torch.load(tmp_path / "step4" / "model.pt", weights_only=True)
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_steps_to_skip_consumes_exactly_those_batches(data_root, tmp_path):
    run_train(base(data_root, tmp_path, "--train.max_steps=6", "--train.steps_to_skip=2-4", "--eval.interval=0"))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "train/skipped_data_step" in r] == [2, 3]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 4, 5, 6]
    trainer = torch.load(tmp_path / "step6" / "trainer.pt", weights_only=True)
    assert trainer["data"]["position"] == 6 * 4  # every step, skipped or not, consumed its 4 sequences


def test_time_limit_stops_with_a_checkpoint(data_root, tmp_path):
    result = run_train(base(data_root, tmp_path, "--train.max_steps=100000", "--train.time_limit=2",
                            "--eval.interval=0"))
    assert "stopped at the time limit" in result.stdout
    step = read_metrics(tmp_path)[-1]["step"]
    assert (tmp_path / f"step{step}" / "COMPLETE").exists()


def test_durations_convert_to_steps():
    assert duration_to_steps("500steps", 1024, 10_000, 1) == 500
    assert duration_to_steps("2e6tokens", 524288, 10_000, 1) == 4  # rounded up: at least 2M tokens
    assert duration_to_steps("3epochs", 1000, 10_000, 1) == 30
    with pytest.raises(ConfigError, match="is not a duration"):
        duration_to_steps("3 fortnights", 1, 1, 1)


def test_chinchilla_duration_uses_the_real_non_embedding_count():
    model = GPT(GPTConfig())  # GPT-2 124M
    n = model.num_params(non_embedding=True)
    assert n == 85_056_000
    # 1x Chinchilla: 20 tokens per non-embedding parameter = 1.70B tokens = 3,245 steps of 2**19 tokens.
    assert duration_to_steps("1chinchilla", 524288, 1, n) == math.ceil(20 * n / 524288) == 3245


def test_max_duration_sets_the_run_length(data_root, tmp_path):
    run_train(base(data_root, tmp_path, "--train.max_duration=512tokens", "--eval.interval=0"))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_step_ranges_parse_and_reject_nonsense():
    assert parse_step_ranges("100-200, 5000-5010") == [(100, 200), (5000, 5010)]
    with pytest.raises(ConfigError, match="is not a range"):
        parse_step_ranges("200-100")


def test_loss_spike_is_flagged_against_the_recent_mean():
    detector = LossSpikeDetector(threshold=1.0)
    rows = [(i, {"train/loss": loss}) for i, loss in enumerate([3.0 + 0.01 * i for i in range(20)] + [4.5, 3.2])]
    detector.flag(rows)
    assert [step for step, values in rows if "train/loss_spike" in values] == [20]


def test_plot_command_writes_non_empty_pngs(data_root, tmp_path):
    run_train(base(data_root, tmp_path / "a", "--train.max_steps=4", "--eval.interval=2"))
    run_train(base(data_root, tmp_path / "b", "--train.max_steps=4", "--eval.interval=2", "--optim.lr=1e-3"))
    result = subprocess.run([sys.executable, "tools/plot_metrics.py", str(tmp_path / "a"), str(tmp_path / "b"),
                             "--out", str(tmp_path / "plots")], cwd=ROOT, capture_output=True, text=True, check=True)
    png = tmp_path / "plots" / "loss_vs_step.png"
    assert str(png) in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert (tmp_path / "plots" / "lr_vs_tokens.png").exists()


def test_the_garbage_collector_runs_every_n_steps_with_automatic_gc_off(data_root, tmp_path, monkeypatch):
    """train.gc_interval (OLMo's GarbageCollector): automatic GC off for the run, a collection of the young
    generations every N steps on every rank, and automatic GC back on after."""
    import gc

    collected = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: collected.append((generation, gc.isenabled())))
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=9",
                      "--train.gc_interval=3", "--eval.interval=0"])
    assert collected == [(1, False)] * 3 and gc.isenabled()
