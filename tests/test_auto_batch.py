"""data.batch_size=auto: the micro-batch chosen by plan.memory_per_rank's estimate against a GPU's memory (given here
as a figure: this machine has no GPU), and refused in one sentence on a CPU, before anything is written."""

import pytest
import torch

from conftest import TINY, assert_one_sentence, run_train
from config import ConfigError, parse_args
from model import GPT
from lab.auto_batch import AUTO_HEADROOM, resolve_batch_size
from plan import memory_per_rank

GB = 1e9


# A small GPT (GPT-2's vocabulary and sequence length, 2 blocks of width 128), and GPUs of a size to match: the same
# arithmetic as GPT-2 on 24 to 80 GB GPUs (docs/fsdp.md's table), at a build that takes no time.
SMALL = ["config/gpt2.py", "--model.n_layer=2", "--model.n_head=2", "--model.n_embd=128"]


def meta_gpt2(argv):
    cfg = parse_args([*SMALL, *argv])
    with torch.device("meta"):
        return cfg, GPT(cfg.model)


def test_auto_takes_the_largest_power_of_two_the_estimate_fits():
    cfg, model = meta_gpt2(["--data.batch_size=auto"])
    tokens, chosen = cfg.model.block_size, {}
    for device_gb in (2, 8):
        chosen[device_gb], line = resolve_batch_size(cfg, model, 1, "cuda", True, device_bytes=device_gb * GB)
        n, budget = chosen[device_gb], (1 - AUTO_HEADROOM) * device_gb * GB
        assert memory_per_rank(model, n * tokens, 1, False, True, "cuda")["total"] <= budget
        assert n == 64 or memory_per_rank(model, 2 * n * tokens, 1, False, True, "cuda")["total"] > budget
        assert n & (n - 1) == 0 and f"{n} sequences per rank" in line and f"{device_gb:.1f} GB" in line
    assert 1 < chosen[2] < chosen[8] < 64
    fsdp, _ = meta_gpt2(["--data.batch_size=auto", "--train.data_parallel=fsdp"])  # the estimate under FSDP
    n, line = resolve_batch_size(fsdp, model, 8, "cuda", True, device_bytes=8 * GB)
    assert memory_per_rank(model, n * tokens, 8, True, True, "cuda")["total"] <= 0.8 * 8 * GB and "FSDP on 8" in line


def test_auto_divides_the_step_and_says_when_nothing_fits():
    cfg, model = meta_gpt2(["--data.batch_size=auto", "--train.total_batch_size=12288"])  # 12 sequences a step
    assert resolve_batch_size(cfg, model, 1, "cuda", True, device_bytes=16 * GB)[0] == 4  # 4 divides 12; 8 does not
    with pytest.raises(ConfigError, match="found no micro-batch"):
        resolve_batch_size(cfg, model, 1, "cuda", True, device_bytes=0.05 * GB)


def test_auto_is_refused_on_a_cpu_in_one_sentence(data_root, tmp_path):
    out = tmp_path / "run"
    result = run_train([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}", "--data.batch_size=auto",
                        "--train.max_steps=2"], check=False)
    assert_one_sentence(result, "data.batch_size=auto fits the micro-batch to a GPU's memory, and this run is on the "
                                "CPU, which has no such limit to fit; set data.batch_size to a number")
    assert not out.exists()
    dry = run_train([*TINY, f"--data.data_root={data_root}", "--data.batch_size=auto", "--dry_run"], check=False)
    assert_one_sentence(dry, "data.batch_size=auto fits the micro-batch to a GPU's memory")
