"""The model ladder: the configurators' numbers against hand computation, and a micro ladder end to end."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import warnings

import pytest

from config import ConfigError
from conftest import run_ladder, run_train
from configurator.model import CPU_DIAL, SIZES, model_config, param_counts, sized_model
from configurator.run import beta2, peak_lr, period_multiples, plan_batch, plan_run, target_batch_tokens
from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- model configurator


def test_size_names_follow_their_rule_and_gpt2_is_on_the_dial():
    gpt2 = model_config("12x768", GPTConfig())
    assert (gpt2.n_layer, gpt2.n_embd, gpt2.n_head) == (12, 768, 12)
    assert model_config("gpt2", GPTConfig()) == gpt2
    assert (model_config("gpt2-xl", GPTConfig()).n_layer, model_config("gpt2-xl", GPTConfig()).n_head) == (48, 25)
    assert model_config("4x32", GPTConfig(block_size=64)).n_head == 1  # narrower than one 64-wide head
    assert model_config("4x32", GPTConfig(block_size=64, bias=False)).bias is False  # the run's other fields stay
    with pytest.raises(ConfigError, match="unknown model size"):
        model_config("3x33x", GPTConfig())


def counts(size, block_size, model_module="model", **fields):
    return param_counts(sized_model(size, GPTConfig(block_size=block_size, **fields), model_module))


def test_parameter_counts_are_the_real_models():
    gpt2 = counts("12x768", 1024)
    real = GPT(model_config("12x768", GPTConfig()))
    assert (gpt2["non_embedding"], gpt2["total"]) == (real.num_params(non_embedding=True), real.num_params())
    assert gpt2["total"] == 124_475_904  # GPT-2 (124M) with the 50,304-row padded vocabulary, as nanoGPT prints
    assert gpt2["with_output"] == gpt2["non_embedding"] + 50304 * 768  # the output layer is the tied embedding
    cpu = [counts(size, 64)["non_embedding"] for size in CPU_DIAL]
    assert all(3.9 < b / a < 4.1 for a, b in zip(cpu, cpu[1:]))  # the CPU dial: width doubles, N grows 4x
    assert len(SIZES) == len(set(SIZES))
    assert model_config("3x192", GPTConfig()).n_head == 3  # any <layers>x<width> of the rule is a size
    with pytest.raises(ConfigError, match="a multiple of 32 below 64 and of 64 from there"):
        model_config("2x96", GPTConfig())


def test_parameter_counts_are_the_runs_own_model_with_its_overrides(tmp_path):
    """The ladder counts the model the run trains: train.model_module's GPT, with every model.* field the run
    set (model.bias=False here), not model.py's GPT-2 of that size."""
    assert counts("2x64", 64, bias=False)["total"] < counts("2x64", 64)["total"]
    untied = tmp_path / "untied.py"
    untied.write_text("import torch.nn as nn, model\nclass GPT(model.GPT):\n    def __init__(self, config, "
                      "loss_path='chunked'):\n        super().__init__(config, loss_path)\n"
                      "        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)\n")
    assert counts("2x64", 64, str(untied))["non_embedding"] == counts("2x64", 64)["non_embedding"] + 50304 * 64


@dataclasses.dataclass
class GroupedQueryConfig(GPTConfig):
    """A fork's field and its check across fields, as a GQA fork adds them to model.py."""
    n_kv_head: int = dataclasses.field(default=2, metadata={"role": "identity", "ladder": False})

    def checks(self):
        return super().checks() + [(self.n_head % self.n_kv_head == 0, f"model.n_head={self.n_head} is not "
                                    f"divisible by model.n_kv_head={self.n_kv_head}; pick values that divide.")]


def test_a_size_whose_shape_breaks_the_models_checks_is_one_sentence():
    """2x32 has one head, which n_kv_head=2 does not divide: every ladder command plans through sized_model, so
    `dry-run --json` refuses as `run` does (it printed a count for a model that cannot exist, with exit 0). A
    check that cannot run on the values (dividing by 0) is one sentence too."""
    assert sized_model("2x128", GroupedQueryConfig(block_size=32)).config.n_head == 2
    with pytest.raises(ConfigError, match=r"^ladder size 2x32: model.n_head=1 is not divisible by model.n_kv_head=2;"):
        sized_model("2x32", GroupedQueryConfig(block_size=32))
    with pytest.raises(ConfigError, match=r"^ladder size 2x128: the model's checks across its fields \(GPTConfig"
                                          r"\.checks\) fail on these values \(ZeroDivisionError: .*\); check the"):
        sized_model("2x128", GroupedQueryConfig(block_size=32, n_kv_head=0))


# ----------------------------------------------------------------------------- run configurator


def test_run_configurator_formulas():
    assert target_batch_tokens(108e6) == 2048 * 160
    assert target_batch_tokens(8 * 108e6) == 2048 * 160 * 4  # (8)^(2/3) = 4
    assert math.isclose(peak_lr(108e6), 0.0047 / 2)
    assert math.isclose(peak_lr(8 * 108e6, lr_multiplier=2), 0.0047 / 2)  # (8)^(-1/3) = 1/2, times 2
    assert beta2(524_288) == 0.95 and beta2(524_287) == 0.99
    assert period_multiples(2) == [0.5, 1, 2] and period_multiples(0.5) == [0.5]
    for bad in (3, 0.25):
        with pytest.raises(ConfigError, match="power of two"):
            period_multiples(bad)


def test_plan_run_periods_and_named_checkpoints_by_hand():
    # N = 1000, batch 100 tokens, 2 x 20 tokens/param: 40,000 tokens = 400 steps; periods end at 0.5x, 1x,
    # 2x Chinchilla = steps 100, 200, 400; decays of 10% of each period: 10, 10, 20 steps.
    plan = plan_run(1000, 100, chinchilla_multiple=2, tokens_per_param=20, lr_multiplier=1, decay_fraction=0.1)
    assert plan.duration_tokens == 40_000 and plan.max_steps == 400
    assert plan.periods == [100, 100, 200]
    assert plan.warmup_steps == 10  # N tokens
    assert plan.checkpoints == [("initialization", 0), ("0.5xC-pre-decay", 90), ("0.5xC-post-decay", 100),
                                ("1xC-pre-decay", 190), ("1xC-post-decay", 200), ("2xC-pre-decay", 380),
                                ("2xC-post-decay", 400)]
    # The duration rounds to the nearest whole batch: 2 x 20 x 1000 / 300 = 133.3 -> 133 batches.
    assert plan_run(1000, 300, chinchilla_multiple=2, tokens_per_param=20, lr_multiplier=1,
                    decay_fraction=0.1).duration_tokens == 133 * 300
    # Warmup (N tokens) must fit in the first period with its decay: at 1 token per parameter it cannot.
    with pytest.raises(ConfigError, match="do not fit in the first period .5 steps.; shorten the warmup"):
        plan_run(1000, 100, chinchilla_multiple=2, tokens_per_param=1, lr_multiplier=1, decay_fraction=0.1)


def test_plan_batch_matches_olmo_by_hand():
    # 8 devices, micro-batch 16,384 tokens: 1e6 / 16,384 = 61.04 -> 61 micro-batches = 999,424 tokens; the
    # devices expand by min(8, 61) = 8; the batch re-rounds to 8 x 16,384 x round(7.625) = 1,048,576.
    plan = plan_batch(1_000_000, 16_384, 4096, 1, None, 8)
    assert (plan.batch_tokens, plan.micro_batch_tokens, plan.devices, plan.dp_world_size, plan.grad_accum_steps) \
        == (1_048_576, 16_384, 8, 8, 8)
    # A model that needs 2 devices per replica (min dp 1): expansion min(8 // 2, 61) = 4 -> 8 devices, dp 4;
    # 999,424 / (4 x 16,384) = 15.25 -> 15 micro-steps.
    plan = plan_batch(1_000_000, 16_384, 4096, 2, 1, 8)
    assert (plan.batch_tokens, plan.devices, plan.dp_world_size, plan.grad_accum_steps) == (983_040, 8, 4, 15)
    # The micro-batch is capped at the target and rounded down to whole sequences: 3,148 -> 3,136 (49 x 64).
    plan = plan_batch(3148, 1_000_000, 64, 1, None, 1)
    assert (plan.batch_tokens, plan.micro_batch_tokens, plan.grad_accum_steps) == (3136, 3136, 1)


def test_plan_batch_warns_past_ten_percent_and_refuses_impossible_meshes():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_batch(10_000, 8192, 1024, 1, None, 8)  # one micro-batch of 8,192: 18% under the target
    assert plan.batch_tokens == 8192
    assert any("18.1% off the target" in str(w.message) and "smaller micro-batch" in str(w.message) for w in caught)
    with pytest.raises(ConfigError, match="not divisible"):
        plan_batch(10_000, 1024, 1024, 3, 2, 8)
    with pytest.raises(ConfigError, match="needs at least 4 devices"):
        plan_batch(10_000, 1024, 1024, 4, None, 2)


# ----------------------------------------------------------------------------- ladder.py


def ladder(*args, check=True):
    result = run_ladder(*args)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def micro_ladder_file(tmp_path, data_root):
    """Three CPU sizes at the CPU rules (a fixed batch, a fixed duration unit, a short warmup), 32 steps
    each: a whole ladder in well under a minute."""
    path = tmp_path / "micro.py"
    path.write_text(f'ladder.name = "micro"\nladder.dir = "{tmp_path / "ladder"}"\n'
                    f'ladder.sizes = ["1x32", "2x32", "2x64"]\nladder.chinchilla_multiple = 1\n'
                    f'ladder.batch_tokens = 256\nladder.duration_tokens = 8192\nladder.warmup_tokens = 512\n'
                    f'ladder.lr_multiplier = 0.1\nladder.val_tokens = 1024\n'
                    f'model.block_size = 32\ndata.data_root = "{data_root}"\neval.sample_interval = 0\n')
    return str(path)


def test_dry_run_json_has_exactly_the_documented_keys(tmp_path, data_root):
    lines = ladder("dry-run", micro_ladder_file(tmp_path, data_root), "--json").stdout.strip().splitlines()
    plans = [json.loads(line) for line in lines]
    assert [p["size"] for p in plans] == ["1x32", "2x32", "2x64"]
    assert set(plans[0]) == {"size", "non_embedding_params", "total_params", "target_batch_tokens", "batch_tokens",
                             "micro_batch_tokens", "min_devices", "devices", "dp_world_size", "grad_accum_steps",
                             "lr", "beta2", "warmup_tokens", "duration_tokens", "max_steps", "checkpoints"}
    p = plans[0]
    assert p["non_embedding_params"] == counts("1x32", 32)["non_embedding"]
    assert p["target_batch_tokens"] == p["batch_tokens"] == 256  # ladder.batch_tokens, not OLMo's rule from N
    assert p["lr"] == peak_lr(p["non_embedding_params"], lr_multiplier=0.1) and p["beta2"] == 0.99
    assert p["warmup_tokens"] == 512 and p["duration_tokens"] == 8192  # the fixed duration unit, 1x
    assert p["checkpoints"][0] == {"name": "initialization", "step": 0, "tokens": 0}
    assert all(c["tokens"] == c["step"] * p["batch_tokens"] for c in p["checkpoints"])
    assert not os.path.exists(tmp_path / "ladder")  # a dry run touches nothing


def test_ladder_file_may_not_set_what_the_ladder_derives(tmp_path, data_root):
    path = micro_ladder_file(tmp_path, data_root)
    with open(path, "a") as f:
        f.write("optim.lr = 1e-3\n")
    result = ladder("dry-run", path, check=False)
    assert result.returncode != 0 and f"{path} sets optim.lr, which the ladder derives" in result.stderr
    assert "Traceback" not in result.stderr
    on_the_command_line = ladder("dry-run", micro_ladder_file(tmp_path, data_root), "--optim.beta2=0.9", check=False)
    assert "error: the command line sets optim.beta2, which the ladder derives" in on_the_command_line.stderr


def test_run_refuses_a_world_size_other_than_planned(tmp_path, data_root):
    path = micro_ladder_file(tmp_path, data_root)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               os.path.join(ROOT, "ladder.py"), "run", path, "--size=1x32"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    assert "size 1x32 is planned for 1 device(s) but this run has 2 process(es)" in result.stderr
    assert not os.path.exists(tmp_path / "ladder" / "1x32")  # refused before anything was written


def test_micro_ladder_end_to_end(tmp_path, data_root):
    path = micro_ladder_file(tmp_path, data_root)
    out = ladder("run-all", path).stdout
    assert out.count("ladder.py run") == 3
    assert "skipped" in ladder("run-all", path).stdout  # finished sizes are not trained again

    rows = [json.loads(line) for line in ladder("checkpoints", path, "--json").stdout.splitlines()]
    assert len(rows) == 3 * 5  # initialization, then pre- and post-decay of the 0.5x and 1x periods
    assert [r["name"] for r in rows[:5]] == ["initialization", "0.5xD-pre-decay", "0.5xD-post-decay",
                                             "1xD-pre-decay", "1xD-post-decay"]
    assert all(r["exists"] and r["metrics"] for r in rows), rows
    assert "✔" in ladder("checkpoints", path).stdout

    csv_path = tmp_path / "metrics.csv"
    table = ladder("metrics", path, "--csv", str(csv_path)).stdout
    assert "val/loss" in table and "initialization" in table
    lines = csv_path.read_text().splitlines()
    assert len(lines) == 1 + 15 and "val/loss" in lines[0]

    # The same ladder read back from a bucket (OLMo-core's alternative_dirs) when ladder.dir has none of it, and every
    # checkpoint found listed with discover_all.
    pytest.importorskip("s3fs", reason="a ladder read back from a bucket needs s3fs (pip install s3fs)")
    pytest.importorskip("moto.server", reason="the bucket tests run moto's S3 server (pip install 'moto[server]')")
    from bucket_fixture import start_s3

    with start_s3():
        from lab import remote
        fs, root = remote.filesystem("s3://runs/ladder-copy")
        fs.put(str(tmp_path / "ladder"), root, recursive=True)
        elsewhere = ["--ladder.dir=" + str(tmp_path / "empty"), "--ladder.alternative_dirs=s3://runs/ladder-copy"]
        rows = [json.loads(line) for line in ladder("checkpoints", path, "--json", *elsewhere).stdout.splitlines()]
        assert len(rows) == 15 and all(r["exists"] and r["metrics"].startswith("s3://") for r in rows)
        assert "val/loss" in ladder("metrics", path, *elsewhere).stdout
        found = [json.loads(line) for line in ladder("checkpoints", path, "--json", *elsewhere,
                                                     "--ladder.discover_all=true").stdout.splitlines()]
        assert {r["step"] for r in found} >= {r["step"] for r in rows}

    fit = ladder("fit", path, "--rounds=10").stdout
    assert "held out, size 2x64" in fit
    result = json.loads((tmp_path / "ladder" / "fit.json").read_text())
    assert set(result["params"]) == {"E", "A", "alpha", "B", "beta"}
    assert [h["size"] for h in result["holdout"]] == ["2x64", "2x64"]
    for h in result["holdout"]:
        assert math.isclose(h["relative_error"], (h["predicted"] - h["measured"]) / h["measured"])
    assert (tmp_path / "ladder" / "fit.png").stat().st_size > 0

    # Each size is an ordinary run: its config.json is that run again, for train.py. It checkpoints as OLMo's ladder:
    # ephemeral checkpoints between the fixed ones, with a cooldown, saved on a thread of their own.
    size_dir = tmp_path / "ladder" / "1x32"
    saved = json.loads((size_dir / "config.json").read_text())["checkpoint"]
    assert (saved["ephemeral_interval"], saved["ephemeral_cooldown"], saved["async_save"]) == (1000, 250, True)
    again = run_train([str(size_dir / "config.json")], check=False)
    assert again.returncode == 0 and "already trained" in again.stdout, again.stdout + again.stderr
    step0 = json.loads((size_dir / "metrics_step0.json").read_text())
    assert step0["val/loss"] > 10  # the untrained model: ~ln(50304) = 10.8


def test_the_time_left_scales_the_last_sizes_speed_by_tokens_and_parameters(tmp_path, data_root):
    import ladder as ladder_module

    cfg = ladder_module.read_config(micro_ladder_file(tmp_path, data_root), [])
    plans = ladder_module.plan_sizes(cfg)
    assert ladder_module.ladder_eta([], plans) == ""  # nothing trained yet: no rate to go by
    minutes = sum(p.params["with_output"] for p in plans[1:]) / plans[0].params["with_output"]  # 1 min for the first
    assert ladder_module.ladder_eta([(plans[0], 60.0)], plans[1:]) == f", about {minutes:.0f} min left for the ladder"
    assert minutes > 2 * 1.5  # the two larger sizes cost more than the first one's minute each
    assert ladder_module.run_config(cfg, plans[0]).log.wandb_project == "micro"  # the ladder's W&B project: its name
    cfg.log.wandb_project = "mine"
    assert ladder_module.run_config(cfg, plans[0]).log.wandb_project == "mine"  # unless set


def test_fit_with_too_few_finished_sizes_says_what_is_missing(tmp_path, data_root):
    result = ladder("fit", micro_ladder_file(tmp_path, data_root), check=False)
    assert result.returncode != 0
    assert "needs three finished sizes" in result.stderr and "1x32 (no val/loss at some post-decay" in result.stderr


def test_benchmark_runs_100_steps_without_checkpoints_or_evals(tmp_path, data_root):
    path = micro_ladder_file(tmp_path, data_root)
    max_steps = json.loads(ladder("dry-run", path, "--size=1x32", "--json").stdout)["max_steps"]
    out = ladder("benchmark", path, "--size=1x32").stdout
    assert "benchmark 1x32:" in out and "tokens/s" in out and "peak memory" in out
    folder = tmp_path / "ladder" / "benchmark" / "1x32"
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == min(100, max_steps) and not any("val/loss" in r for r in rows)
    assert not list(folder.glob("step*")) and list((folder / "profiler").iterdir())


@pytest.mark.parametrize("config_file", ["ladder_shakespeare.py", "ladder_shakespeare_muon.py", "ladder_gpt2.py"])
def test_every_ladder_config_file_plans_and_says_which_sizes_need_fsdp(config_file):
    result = run_ladder("dry-run", f"config/{config_file}")
    assert result.returncode == 0, result.stderr
    memory = [line for line in result.stdout.splitlines() if line.strip().startswith("memory")]
    assert memory and all("per device with DDP" in line and "with FSDP on" in line for line in memory)
    assert all(line.rstrip().endswith("(plan.memory_per_rank)") for line in memory)


def test_a_size_past_one_device_with_ddp_is_said_to_need_fsdp():
    from configurator.model import memory_fit

    def model(size, block_size):
        return sized_model(size, GPTConfig(block_size=block_size))

    assert memory_fit(model("2x64", 64), "cpu", 512, 1)[3] == "fits with DDP"
    ddp, fsdp, memory, verdict = memory_fit(model("gpt2-xl", 1024), "A10G", 1024, 8)  # 1.5B on 24 GiB cards
    assert ddp > memory >= fsdp and verdict == "needs FSDP"
    assert memory_fit(model("gpt2-xl", 1024), "T4", 65536, 1)[3] == "does not fit"
