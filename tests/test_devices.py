"""The device table (plan.py), and Apple silicon stood in for: no machine here has one, so torch's MPS
checks and calls are replaced by fakes and the tensors stay on this CPU. The quick start's config runs
through every branch of the MPS row, and nothing CUDA-only is called."""

import dataclasses

import pytest
import torch

import plan
import train
from conftest import ROOT, assert_one_sentence, read_metrics, run_in_process

GIB = 2**30
# config/shakespeare.py (Muon, GPT-2's vocabulary), smaller and shorter: validation at steps 2 and 4,
# a checkpoint at the end, a metrics row every step
QUICK_START = [str(ROOT / "config" / "shakespeare.py"), "--model.n_layer=2", "--model.n_head=2",
               "--model.n_embd=32", "--model.block_size=32", "--data.batch_size=4",
               "--train.total_batch_size=128", "--train.max_steps=4", "--optim.warmup_steps=1",
               "--eval.interval=2", "--eval.val_steps=1", "--eval.sample_interval=0", "--log.interval=1"]
CUDA_ONLY = ("synchronize", "Event", "memory_allocated", "memory_reserved", "max_memory_allocated",
             "get_device_name", "set_device", "is_bf16_supported", "device_count")


@pytest.fixture
def a_mac(monkeypatch):
    """A machine with MPS and no CUDA. Returns the calls made: MPS's fakes, any CUDA-only call, and what
    the trainer was given from the table."""
    calls = []
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(plan.DEVICES, "cuda", dataclasses.replace(plan.DEVICES["cuda"], available=lambda: False))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps.synchronize"))
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 3 * GIB)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 5 * GIB)
    for name in CUDA_ONLY:
        monkeypatch.setattr(torch.cuda, name, lambda *args, name=name, **kwargs: calls.append(f"cuda.{name}"))
    start_processes, build_optimizer, build_loaders = train.start_processes, train.build_optimizer, train.build_loaders

    def on_this_cpu(cfg):  # an MPS's tensors live on this CPU; the placement keeps MPS's row
        place = start_processes(cfg)
        calls.append(f"placed on {place.device}, autocast {type(place.autocast).__name__}")
        return dataclasses.replace(place, device="cpu")

    monkeypatch.setattr(train, "start_processes", on_this_cpu)
    monkeypatch.setattr(train, "build_optimizer", lambda *args: calls.append(f"fused {args[2]}") or build_optimizer(*args))
    monkeypatch.setattr(train, "build_loaders", lambda *args: calls.append(f"pinned {args[4]}") or build_loaders(*args))
    return calls


@pytest.mark.parametrize("device", ["mps", "auto"])
def test_the_quick_start_trains_on_a_stand_in_mps_through_its_row_of_the_table(a_mac, data_root, tmp_path,
                                                                                  device):
    out = tmp_path / "run"
    result = run_in_process(QUICK_START + [f"--train.device={device}", f"--data.data_root={data_root}",
                                           f"--train.out_dir={out}"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert [c for c in a_mac if c.startswith("cuda.")] == []  # nothing CUDA-only
    assert "placed on mps, autocast nullcontext" in a_mac  # auto picks MPS; float32
    assert "fused False" in a_mac and "pinned False" in a_mac
    assert "torch.compile" not in result.stdout and "chunked in" in result.stdout  # compile off: chunked loss
    # The clock waits for MPS before and after each pause: validation at steps 2 and 4, the checkpoint.
    assert a_mac.count("mps.synchronize") == 2 * 3
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and (out / "step4").is_dir()
    for row in rows:  # memory from MPS's allocator; MFU not printed (no known peak)
        assert row["system/gpu_memory_allocated_gb"] == 3.0 and row["system/gpu_memory_reserved_gb"] == 5.0
        assert "system/cpu_rss_gb" not in row and "throughput/mfu" not in row


def test_mps_under_torchrun_is_one_sentence_before_anything_is_written(a_mac, data_root, tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    result = run_in_process(QUICK_START + ["--train.device=mps", f"--data.data_root={data_root}",
                                           f"--train.out_dir={out}"])
    assert_one_sentence(result, "--train.device=mps runs in one process", "no DDP or FSDP", "--train.device=cpu")
    assert not out.exists()
    assert plan.pick_device("auto", processes=2) == "cpu"  # auto under torchrun on a Mac: gloo on its CPU


def test_auto_picks_cuda_then_mps_then_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setitem(plan.DEVICES, "cuda", dataclasses.replace(plan.DEVICES["cuda"], available=lambda: True))
    assert plan.pick_device("auto") == "cuda"
    monkeypatch.setitem(plan.DEVICES, "cuda", dataclasses.replace(plan.DEVICES["cuda"], available=lambda: False))
    assert plan.pick_device("auto") == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert plan.pick_device("auto") == "cpu"


def test_mps_on_a_machine_without_one_is_one_sentence(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(plan.UserError, match=r"--device=mps but this torch sees no Apple GPU \(MPS\); give"):
        plan.pick_device("mps")
