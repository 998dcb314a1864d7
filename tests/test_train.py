import math

import pytest

from conftest import TINY, read_metrics, run_train


def test_train_py_runs_end_to_end_and_logs_metrics_and_samples(data_root, tmp_path):
    out = tmp_path / "run"
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=6",
                               "--eval.interval=3", "--eval.sample_interval=6", "--eval.sample_tokens=8"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for key in ["tokens", "train/loss", "train/grad_norm", "optim/lr", "throughput/tokens_per_sec"]:
        assert all(key in r for r in rows), key
    assert [r["step"] for r in rows if "val/loss" in r] == [3, 6]
    assert rows[-1]["tokens"] == 6 * 128
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert "--- step 6, sample 0" in (out / "samples.txt").read_text()
    assert "--- step 6, sample 0" in result.stdout
    console = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(console) == 6 and console[-1].startswith("step      6 | loss ")  # log.interval=1
    assert (out / "config.json").exists()


def test_console_prints_every_log_interval_and_the_last_step(data_root, tmp_path):
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=7",
                               "--log.interval=3", "--log.metrics_collect_interval=2", "--eval.interval=0"])
    console = [line.split("|")[0].split()[1] for line in result.stdout.splitlines() if line.startswith("step ")]
    assert console == ["3", "6", "7"]
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 8))


def test_two_gloo_ranks_match_one_rank_with_accumulation(data_root, tmp_path):
    common = TINY + [f"--data.data_root={data_root}", "--train.max_steps=4", "--eval.interval=2",
                     "--train.total_batch_size=256"]
    run_train(common + [f"--train.out_dir={tmp_path / 'one'}"])  # 1 rank x 2 micro-steps of 4 x 32 tokens
    run_train(common + [f"--train.out_dir={tmp_path / 'two'}"], nproc=2)  # 2 ranks x 1 micro-step
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
        assert ("val/loss" in a) == ("val/loss" in b)
        if "val/loss" in a:
            assert a["val/loss"] == pytest.approx(b["val/loss"], rel=1e-5)
    assert [r["step"] for r in one if "val/loss" in r] == [2, 4]
    assert one[-1]["train/loss"] != one[0]["train/loss"]


def test_batch_that_does_not_divide_fails_with_the_numbers(data_root, tmp_path):
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}",
                               "--train.total_batch_size=100"], check=False)
    assert result.returncode != 0
    assert "train.total_batch_size=100 is not a multiple of" in result.stderr
    assert "4 x 32 x 1 = 128" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_dataset_names_the_command_that_prepares_it(tmp_path):
    result = run_train(TINY + [f"--data.data_root={tmp_path}", "--data.dataset=fineweb-edu",
                               f"--train.out_dir={tmp_path / 'out'}"], check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "python prepare_data.py fineweb-edu" in result.stderr


def test_no_checkpoints_and_no_evals_switch_them_off(data_root, tmp_path):
    """OLMo-core's benchmarking switches: nothing saved, nothing evaluated, training as usual."""
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=4",
                      "--eval.interval=2", "--eval.sample_interval=2", "--checkpoint.interval=2",
                      "--train.no_checkpoints=true", "--train.no_evals=true"])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert not any("val/loss" in r for r in rows)
    assert not list(tmp_path.glob("step*"))
    assert not (tmp_path / "samples.txt").exists() or "--- step" not in (tmp_path / "samples.txt").read_text()


def test_step_zero_evaluates_and_keeps_the_untrained_model(data_root, tmp_path):
    """eval.fixed_steps / checkpoint.fixed_steps may hold 0: before the first step (the ladder's initialization)."""
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=2",
                      "--eval.interval=0", "--eval.fixed_steps=0,2", "--checkpoint.fixed_steps=0"])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "val/loss" in r] == [0, 2]
    assert rows[0]["val/loss"] > 10  # ~ln(50304): nothing learned yet
    assert (tmp_path / "metrics_step0.json").exists() and (tmp_path / "step0").is_dir()
    resumed = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=3",
                                "--eval.interval=0", "--eval.fixed_steps=0,2", "--checkpoint.fixed_steps=0"])
    assert "resumed from" in resumed.stdout
    assert [r["step"] for r in read_metrics(tmp_path)].count(0) == 1  # step 0 is not evaluated again


# ----------------------------------------------------------------------------- one step, in this process


class ListLoader:
    """Hands out fixed (x, y) batches: train_step needs next_batch() and a device."""
    device = "cpu"

    def __init__(self, batches):
        self.batches = list(batches)

    def next_batch(self):
        return self.batches.pop(0)


def tiny_gpt(seed=0):
    import torch

    from model import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))


def adamw(net):
    from config import parse_args
    from optimizer import build_optimizer
    return build_optimizer(net, parse_args(["--optim.lr=1e-2"]).optim)


def test_train_step_over_two_micro_steps_equals_one_step_over_their_union():
    """Dividing each micro-step's loss by the number of micro-steps makes the summed gradients the
    gradient of the whole batch: one optimizer step, the same update (plain SGD, whose update is the
    gradient itself; Adam's first step is about sign(gradient), which rounding can flip where it is ~0)."""
    from contextlib import nullcontext

    import torch

    from train import train_step
    x = torch.randint(0, 500, (8, 17), generator=torch.Generator().manual_seed(1))
    halves = [(x[:4, :-1], x[:4, 1:]), (x[4:, :-1], x[4:, 1:])]
    results = []
    for loader, micro_steps in ((ListLoader(halves), 2), (ListLoader([(x[:, :-1], x[:, 1:])]), 1)):
        net = tiny_gpt()
        sgd = torch.optim.SGD(net.parameters(), lr=1.0)
        step_metrics, _ = train_step(net, sgd, loader, micro_steps, nullcontext(), grad_clip=1.0)
        results.append((step_metrics, [p.detach().clone() for p in net.parameters()]))
    (two, weights_two), (one, weights_one) = results
    assert two["train/loss"].item() == pytest.approx(one["train/loss"].item(), rel=1e-6)
    assert two["train/grad_norm"].item() == pytest.approx(one["train/grad_norm"].item(), rel=1e-5)
    for a, b in zip(weights_two, weights_one):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_nonfinite_step_is_skipped_without_an_update_under_nan_policy_skip():
    from contextlib import nullcontext

    import torch

    from plan import StepOptions
    from train import train_step
    net = tiny_gpt()
    x = torch.randint(0, 500, (4, 17))
    with torch.no_grad():
        net.transformer.ln_f.weight[0] = float("nan")  # every loss from here on is NaN
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    step_metrics, _ = train_step(net, adamw(net), ListLoader([(x[:, :-1], x[:, 1:])]), 1, nullcontext(),
                                 grad_clip=1.0, options=StepOptions(nan_policy="skip"))
    assert step_metrics == {"train/skipped_nonfinite_step": 1.0}
    assert all(p.grad is None for p in net.parameters())  # the gradients are dropped ...
    for name, p in net.named_parameters():  # ... and no weight moved
        assert torch.equal(p.nan_to_num(), before[name].nan_to_num()), name


class SyncCounter:
    """Counts the calls that copy a tensor's value to the host (a host-device sync on a GPU) made from
    this project's files, by file: torch.cuda's own sync detector needs a GPU, this works on a CPU."""

    METHODS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        import collections
        import sys

        import torch
        from conftest import ROOT
        self.calls = collections.Counter()
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counting(tensor, *args, _original=original, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if caller.startswith(str(ROOT)) and "/tests/" not in caller:
                    self.calls[caller.rsplit("/", 1)[-1]] += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counting)


def test_train_step_never_waits_for_the_device_unless_nan_policy_skip(monkeypatch):
    from contextlib import nullcontext

    import torch

    from plan import StepOptions
    from train import train_step
    x = torch.randint(0, 500, (8, 17))
    syncs = SyncCounter(monkeypatch)
    net = tiny_gpt()
    train_step(net, adamw(net), ListLoader([(x[:4, :-1], x[:4, 1:]), (x[4:, :-1], x[4:, 1:])]), 2, nullcontext(),
               grad_clip=1.0, options=StepOptions(layer_norms=True))
    assert sum(syncs.calls.values()) == 0, syncs.calls
    train_step(net, adamw(net), ListLoader([(x[:, :-1], x[:, 1:])]), 1, nullcontext(), grad_clip=1.0,
               options=StepOptions(nan_policy="skip"))
    assert syncs.calls == {"train.py": 1}  # nan_policy=skip must know now: one sync per step, by design


def test_the_loop_syncs_only_when_it_collects_metrics(data_root, tmp_path, monkeypatch):
    """8 steps, metrics collected every 4 (and a console line every 4, which collects too): the metrics' two
    collections are the only copies to the host, but for the one that reads the loss path's check before the first
    step (model.fast_loss_problem)."""
    syncs = SyncCounter(monkeypatch)
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=8",
                      "--log.metrics_collect_interval=4", "--log.interval=4", "--eval.interval=0",
                      "--train.no_checkpoints=true"])
    assert syncs.calls == {"metrics.py": 2, "model.py": 1}, syncs.calls
    assert len(read_metrics(tmp_path)) == 8


def test_start_summary_and_console_eta(data_root, tmp_path):
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=3"])
    assert "model: 1,636,224 parameters (25,472 non-embedding)" in result.stdout
    assert "run: 3 steps x 128 tokens = 384 tokens (0.0 per non-embedding parameter" in result.stdout
    assert "training FLOPs" in result.stdout
    assert "| eta 0:00:00" in result.stdout


def test_the_console_line_prints_at_log_interval_on_the_step_it_describes(data_root, tmp_path, monkeypatch):
    """log.interval=3 with metrics collected every 10 steps: the line of step 3 comes out before step 4 trains
    (it used to wait for the collection at step 7, the last)."""
    import train

    def marked_step(*args, **kwargs):
        print("(a step trains)")
        return train_step(*args, **kwargs)

    train_step = train.train_step
    monkeypatch.setattr(train, "train_step", marked_step)
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=7",
                               "--log.interval=3", "--log.metrics_collect_interval=10", "--eval.interval=0"])
    events = [line.split()[1] if line.startswith("step ") else "train" for line in result.stdout.splitlines()
              if line.startswith("step ") or line == "(a step trains)"]
    assert events == ["train"] * 3 + ["3"] + ["train"] * 3 + ["6"] + ["train", "7"], events
