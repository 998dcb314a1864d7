"""What the trainer prints, logs and documents is what happened, and a refused command changes nothing.

Each test is named after the behaviour; the issue's item number is in the comment above it.
(The config roles, items 1-2 and 14, are in test_config_roles.py.)
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import metrics
from checkpoint import find_checkpoints
from conftest import ROOT, TINY, read_metrics, run_in_process, run_train
from config import ConfigError, UserError, parse_args, run_command
from train import TORCH_FLOOR, check_torch
from optimizer import build_schedule


def args(data_root, out, *extra):
    return TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0", *extra]


def snapshot(folder):
    return {os.path.relpath(os.path.join(d, f), folder): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, files in os.walk(folder) for f in files}


# ----------------------------------------------------------------------------- settings that are used (3-5)


# 3
def test_fine_tuning_from_load_path_trains_with_the_new_lr_and_logs_it_from_the_optimizer(data_root, tmp_path):
    run_train(args(data_root, tmp_path / "a", "--train.max_steps=2", "--optim.warmup_steps=1", "--optim.lr=1e-3"))
    tuned = ["--train.max_steps=4", "--optim.warmup_steps=1", "--optim.lr=1e-5", "--optim.min_lr=0"]
    run_train(args(data_root, tmp_path / "b", *tuned, f"--checkpoint.load_path={tmp_path / 'a'}"))
    schedule = build_schedule(parse_args(TINY + tuned).optim, 4)
    for row in read_metrics(tmp_path / "b"):
        assert row["optim/lr/adamw"] == row["optim/lr"] == pytest.approx(schedule.lr_at(row["step"]), rel=1e-12)
        assert row["optim/lr/adamw"] <= 1e-5


# 4
def test_load_path_with_other_optimizer_groups_is_one_sentence_before_anything_is_written(data_root, tmp_path):
    run_train(args(data_root, tmp_path / "a", "--train.max_steps=2"))
    result = run_train(args(data_root, tmp_path / "b", "--train.max_steps=2", "--optim.decay_embeddings=false",
                            f"--checkpoint.load_path={tmp_path / 'a'}"), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "optim.decay_embeddings differ" in result.stderr and "--checkpoint.load_optim=false" in result.stderr
    assert not (tmp_path / "b").exists()


# 5
def test_the_ladder_refuses_a_checkpoint_interval_it_would_silently_override():
    import ladder

    with pytest.raises(ConfigError, match="sets checkpoint.interval, which the ladder derives"):
        ladder.read_config(str(ROOT / "config" / "ladder_shakespeare.py"), ["--checkpoint.interval=5"])


# ----------------------------------------------------------------------------- speed and counts (6-8)


# 6
def test_step_times_include_the_wait_for_collected_metrics_and_add_up_to_the_wall_time(
        data_root, tmp_path, monkeypatch):
    collect = metrics.MetricRecorder.collect

    def slow_collect(self):  # the host waiting for a slow device at the collecting sync
        time.sleep(0.3)
        return collect(self)

    monkeypatch.setattr(metrics.MetricRecorder, "collect", slow_collect)
    start = time.perf_counter()
    run_train(args(data_root, tmp_path / "run", "--train.max_steps=5", "--log.metrics_collect_interval=1",
                   "--checkpoint.interval=2"))
    wall = time.perf_counter() - start
    rows = read_metrics(tmp_path / "run")
    step_times = [r["throughput/step_time_sec"] for r in rows]
    aside = sum(r.get("throughput/checkpoint_time_sec", 0) + r.get("throughput/eval_time_sec", 0) for r in rows)
    assert all(t >= 0.3 for t in step_times[1:])  # each collect after steps 1-4 counts in the next step
    assert sum(step_times) + aside < wall  # and nothing is counted twice
    # Each checkpoint's time is in its own step's row, the final checkpoint's (step 5) included.
    assert [r["step"] for r in rows if "throughput/checkpoint_time_sec" in r] == [2, 4, 5]


# 7
def test_skipped_steps_log_no_throughput_and_count_no_tokens_or_sequences(mixture_root, tmp_path):
    run_train(TINY + [f"--data.data_root={mixture_root}", f"--train.out_dir={tmp_path / 'run'}", "--eval.interval=0",
                      "--data.mix=shakespeare:3,python:1", "--train.max_steps=5", "--train.steps_to_skip=3-5"])
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    assert all("throughput/tokens_per_sec" not in rows[s] and "throughput/mfu" not in rows[s] for s in (3, 4))
    assert [rows[s]["tokens"] for s in range(1, 6)] == [128, 256, 256, 256, 384]  # steps 1, 2 and 5 trained
    sequences = sum(v for k, v in rows[5].items() if k.startswith("data/") and k.endswith("/sequences"))
    assert sequences == 3 * 128 // 32
    assert rows[5]["throughput/total_petaflops"] == pytest.approx(rows[2]["throughput/total_petaflops"] * 1.5)


# 8
def test_a_run_whose_steps_all_fail_under_nan_policy_skip_stops_with_a_sentence(data_root, tmp_path):
    result = run_train(args(data_root, tmp_path / "run", "--train.max_steps=30", "--optim.lr=1e30",
                            "--train.nan_policy=skip", "--train.nan_skip_limit=3",
                            "--log.metrics_collect_interval=1"), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    stop = int(re.search(r"non-finite at 3 steps in a row up to step (\d+)", result.stderr).group(1))
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["step"] == stop < 30 and rows[-1]["train/nonfinite_steps_skipped"] == 3  # on record, then stopped
    skipped = [r for r in rows if "train/skipped_nonfinite_step" in r]
    assert len(skipped) == 3 and all("throughput/tokens_per_sec" not in r for r in skipped)
    assert len({r["tokens"] for r in rows[-4:]}) == 1  # a skipped step trained no tokens
    assert find_checkpoints(tmp_path / "run") == []


# ----------------------------------------------------------------------------- refused commands (12)


# 12
def test_a_refused_rewind_moves_nothing_and_a_cut_short_one_is_finished_in_place(data_root, tmp_path):
    out = tmp_path / "run"
    common = args(data_root, out, "--train.max_steps=6", "--checkpoint.interval=2")
    run_train(common)
    before = snapshot(out)
    refused = run_train(common + ["--checkpoint.resume_step=2", "--train.seed=7"], check=False)
    assert refused.returncode == 1 and "train.seed" in refused.stderr
    assert snapshot(out) == before and not (out / "rewinds.jsonl").exists()
    both = run_train(common + ["--checkpoint.resume_step=2", "--train.seed=7", "--checkpoint.save_overwrite=true"],
                     check=False)  # rewind this run and replace it by another: refused, not both
    assert both.returncode == 1 and "train.seed" in both.stderr and snapshot(out) == before
    # A kill -9 after the first move of a rewind: step6 already aside, step4 not yet.
    partial = out / "rewound" / "20260101-000000_to_step2.partial"
    partial.mkdir(parents=True)
    os.replace(out / "step6", partial / "step6")
    run_train(common + ["--checkpoint.resume_step=2"])
    (aside,) = (out / "rewound").iterdir()
    assert aside.name == "20260101-000000_to_step2" and sorted(os.listdir(aside)) == ["metrics.jsonl", "step4", "step6"]
    assert len((out / "rewinds.jsonl").read_text().splitlines()) == 1
    again = run_train(common + ["--checkpoint.resume_step=2"])  # a restarted job: no second rewind
    assert "already rewound to step 2" in again.stdout and len(list((out / "rewound").iterdir())) == 1
    on_purpose = run_train(common + ["--checkpoint.resume_step=2", "--checkpoint.rewind_number=2"])
    assert "rewound to step 2: checkpoints 4, 6" in on_purpose.stdout
    assert len(list((out / "rewound").iterdir())) == 2 and [s for s, _ in find_checkpoints(out)] == [2, 4, 6]


# ----------------------------------------------------------------------------- correctness on several ranks (15-18)


# 15
def test_ranks_draw_different_dropout_masks(data_root, tmp_path):
    run_train(args(data_root, tmp_path / "run", "--train.max_steps=2", "--train.total_batch_size=256",
                   "--model.dropout=0.1"), nproc=2)
    rng = torch.load(tmp_path / "run" / "step2" / "trainer.pt", weights_only=True)["rng"]
    assert len(rng) == 2 and not torch.equal(rng[0]["torch"], rng[1]["torch"])


# 16
def test_a_user_error_on_another_rank_says_why_with_its_rank(monkeypatch, capsys):
    def fails(argv):
        raise UserError("shard 3 is missing; prepare it again.")

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as stopped:
        run_command(fails, [])
    assert stopped.value.code == 2
    assert "error (rank 1): shard 3 is missing; prepare it again." in capsys.readouterr().err


# 17
def test_a_stop_saves_its_checkpoint_without_evaluating_first(data_root, tmp_path):
    result = run_train(args(data_root, tmp_path / "run", "--train.max_steps=6", "--eval.interval=1",
                            "--eval.sample_interval=1", "--train.time_limit=1e-9"))
    assert "stopped at the time limit (train.time_limit) after step 1" in result.stdout
    (row,) = read_metrics(tmp_path / "run")
    assert "val/loss" not in row and not (tmp_path / "run" / "samples.txt").exists()
    assert [s for s, _ in find_checkpoints(tmp_path / "run")] == [1]


# 18
def test_rank_0_alone_verifies_the_checkpoint_and_tells_the_other_ranks(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=2", "--train.total_batch_size=256"))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    str(ROOT / "tests" / "start_on_two_ranks.py"), str(out), str(tmp_path / "start")],
                   cwd=ROOT, check=True, capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    zero, one = (json.loads((tmp_path / f"start{rank}.json").read_text()) for rank in (0, 1))
    assert zero["path"] == one["path"] == str(out / "step2") and zero["resumed"] and one["resumed"]
    assert zero["hashed"] == 3 and one["hashed"] == 0  # model, optim and trainer .pt: once, on rank 0


# ----------------------------------------------------------------------------- metrics that mean what they say (19-20)


# 19
def test_per_layer_gradient_norms_are_taken_before_clipping_as_the_total_is(data_root, tmp_path):
    run_train(args(data_root, tmp_path / "run", "--train.max_steps=2", "--optim.grad_clip=0.01",
                   "--log.grad_norms_interval=1"))
    for row in read_metrics(tmp_path / "run"):
        layers = [v for k, v in row.items() if k.startswith("grad/")]
        assert max(layers) > 0.01  # clipping to 0.01 would have scaled every one below it
        assert math.sqrt(sum(v * v for v in layers)) <= row["train/grad_norm"] * (1 + 1e-5)


# 20
def test_the_stated_torch_floor_is_the_one_the_code_checks():
    floor = re.search(r"^torch>=([\d.]+)", (ROOT / "requirements.txt").read_text(), re.M).group(1)
    assert tuple(int(p) for p in floor.split(".")) == TORCH_FLOOR
    check_torch(torch.__version__)  # this torch is new enough
    assert hasattr(torch.optim, "Muon")
    with pytest.raises(UserError, match=r"needs torch 2\.9 or newer"):
        check_torch("2.8.0+cu128")


# ----------------------------------------------------------------------------- one sentence, nothing written (23-24)


# 23
@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_train_on_a_gpu_this_torch_does_not_see_is_one_sentence(data_root, tmp_path):
    result = run_train(args(data_root, tmp_path / "run", "--train.device=cuda"), check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--train.device=cuda but this torch sees no CUDA GPU" in result.stderr and not (tmp_path / "run").exists()


# 23
def test_an_infinite_duration_is_one_sentence(data_root, tmp_path):
    result = run_train(args(data_root, tmp_path / "run", "--train.max_duration=1e400tokens"), check=False)
    assert result.returncode == 1 and "train.max_duration='1e400tokens' is not a duration" in result.stderr


# 24
def test_checkpoint_list_verifies_like_the_loader_and_lists_one_checkpoint_folder(data_root, tmp_path):
    import checkpoint

    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2"))
    with open(out / "step4" / "optim.pt", "r+b") as f:
        f.truncate(100)
    listed = run_in_process(["list", str(out)], checkpoint.main)
    assert re.search(r"step +2 +permanent +\S+step2 +complete", listed.stdout)
    assert re.search(r"step +4 +permanent +\S+step4 +damaged: .*optim.pt does not match its checksum", listed.stdout)
    one = run_in_process(["list", str(out / "step2")], checkpoint.main)
    assert one.returncode == 0 and re.fullmatch(r"step +2 +permanent +\S+step2 +complete\n", one.stdout)
    empty = run_in_process(["list", str(tmp_path)], checkpoint.main)
    assert empty.returncode == 1 and "holds no complete checkpoint" in empty.stderr


# 24
def test_the_dry_run_warns_of_a_one_step_decay_to_zero(data_root):
    result = run_train(["--train.max_steps=100", "--optim.warmup_steps=10", "--optim.schedule=wsd",
                        "--optim.decay_steps=1", "--optim.min_lr=0", f"--data.data_root={data_root}", "--dry_run"])
    assert "warning: a decay of one step trains that step at LR 0" in result.stdout
    fine = run_train(["--train.max_steps=100", "--optim.warmup_steps=10", "--optim.schedule=wsd",
                      "--optim.decay_steps=2", "--optim.min_lr=0", f"--data.data_root={data_root}", "--dry_run"])
    assert "warning" not in fine.stdout


def test_the_compile_notice_says_what_it_measured_not_a_constant():
    # 10: the first compiled step's time is printed as measured (compile_time); no fixed figure is claimed.
    import inspect

    import train

    assert not re.search(r"\d+ s for GPT-2", inspect.getsource(train))


def test_a_run_that_replaces_another_starts_without_its_rewind_and_change_logs(data_root, tmp_path, monkeypatch):
    import run_dir
    monkeypatch.setattr(run_dir.time, "strftime", lambda *a: "20260101-000000")  # both rewinds in one second
    out = tmp_path / "run"
    run_train(args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2"))
    run_train(args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2", "--checkpoint.resume_step=2"))
    assert (out / "rewinds.jsonl").exists()
    run_train(args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2", "--train.seed=7",
                   "--checkpoint.save_overwrite=true"))
    assert not (out / "rewinds.jsonl").exists()
    again = run_train(args(data_root, out, "--train.max_steps=4", "--checkpoint.interval=2", "--train.seed=7",
                           "--checkpoint.resume_step=2"))
    assert "rewound to step 2: checkpoints 4" in again.stdout  # the new run's first rewind is not skipped
    assert sorted(os.listdir(out / "rewound")) == ["20260101-000000-2_to_step2", "20260101-000000_to_step2"]


def test_a_warmup_longer_than_the_run_is_refused_before_data_is_prepared(tmp_path):
    result = run_in_process(["--train.max_steps=60", "--optim.warmup_steps=1000", f"--data.data_root={tmp_path / 'd'}",
                             f"--train.out_dir={tmp_path / 'run'}"])
    assert result.returncode == 1 and "optim.warmup_steps=1000 is longer than the run (60 steps)" in result.stderr
    assert os.listdir(tmp_path) == []


def test_a_load_path_that_is_neither_a_folder_nor_a_gpt2_name_is_one_sentence(data_root, tmp_path):
    result = run_train(args(data_root, tmp_path / "run", "--checkpoint.load_path=gpt2-small"), check=False)
    assert result.returncode == 1 and "checkpoint.load_path=gpt2-small is not a folder nor one of gpt2" in result.stderr
    assert not (tmp_path / "run").exists()
