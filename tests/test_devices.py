"""The device table (devices.py), and Apple silicon stood in for: no machine here has one, so torch's MPS
checks and calls are replaced by fakes and the tensors stay on this CPU. The quick start's config runs
through every branch of the MPS row, and nothing CUDA-only is called. Then a run cancelled from W&B,
whose client is stood in for too (tests/fake_wandb/)."""

import dataclasses
import json
import os
import sys

import pytest
import torch

import devices
import train
from checkpoint import find_checkpoints, read_trainer_state
from conftest import ROOT, TINY, assert_one_sentence, read_metrics, run_in_process, run_train

GIB = 2**30
# config/shakespeare.py (Muon, GPT-2's vocabulary), smaller and shorter: validation at steps 2 and 4,
# a checkpoint at the end, a metrics row every step
QUICK_START = [str(ROOT / "config" / "shakespeare.py"), "--model.n_layer=2", "--model.n_head=2",
               "--model.n_embd=32", "--model.block_size=32", "--data.batch_size=4",
               "--train.total_batch_size=128", "--train.max_steps=4", "--optim.warmup_steps=1",
               "--eval.interval=2", "--eval.val_steps=1", "--eval.sample_interval=0", "--log.interval=1"]
CUDA_ONLY = ("synchronize", "Event", "memory_allocated", "memory_reserved", "max_memory_allocated",
             "get_device_name", "set_device", "is_bf16_supported", "device_count", "get_rng_state",
             "set_rng_state")


@pytest.fixture
def a_mac(monkeypatch):
    """A machine with MPS and no CUDA. Returns the calls made: MPS's fakes, any CUDA-only call, and what
    the trainer was given from the table."""
    calls = []
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(devices.DEVICES, "cuda", dataclasses.replace(devices.DEVICES["cuda"], available=lambda: False))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps.synchronize"))
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 3 * GIB)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 5 * GIB)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: torch.tensor([7], dtype=torch.uint8))
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda state: calls.append(f"mps.set_rng_state {state.tolist()}"))
    for name in CUDA_ONLY:
        monkeypatch.setattr(torch.cuda, name, lambda *args, name=name, **kwargs: calls.append(f"cuda.{name}"))
    start_processes, build_optimizer, build_loaders = train.start_processes, train.build_optimizer, train.build_loaders

    def on_this_cpu(cfg):  # an MPS's tensors live on this CPU; the placement keeps MPS's row
        place = start_processes(cfg)
        calls.append(f"placed on {place.device}, autocast {type(place.autocast).__name__}")
        return dataclasses.replace(place, device="cpu")

    monkeypatch.setattr(train, "start_processes", on_this_cpu)
    monkeypatch.setattr(train, "build_optimizer",
                        lambda *args: calls.append(f"fused {args[2]}") or build_optimizer(*args))
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
    resumed = run_in_process(QUICK_START + [f"--train.device={device}", f"--data.data_root={data_root}",
                                            f"--train.out_dir={out}", "--train.max_steps=5"])
    assert resumed.returncode == 0 and "mps.set_rng_state [7]" in a_mac  # MPS's random state, saved and put back
    assert [c for c in a_mac if c.startswith("cuda.")] == []


def test_mps_under_torchrun_is_one_sentence_before_anything_is_written(a_mac, data_root, tmp_path, monkeypatch):
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    result = run_in_process(QUICK_START + ["--train.device=mps", f"--data.data_root={data_root}",
                                           f"--train.out_dir={out}"])
    assert_one_sentence(result, "--train.device=mps runs in one process", "no DDP or FSDP", "--train.device=cpu")
    assert not out.exists()
    assert devices.pick_device("auto", processes=2) == "cpu"  # auto under torchrun on a Mac: gloo on its CPU


def test_a_micro_batch_fit_to_gpu_memory_is_refused_on_mps_in_one_sentence():
    from config import ConfigError, parse_args
    from lab.auto_batch import resolve_batch_size
    from model import GPT

    cfg = parse_args(["--data.batch_size=auto"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    with pytest.raises(ConfigError, match=r"this run is on Apple's MPS, .*; set data.batch_size to a number"):
        resolve_batch_size(cfg, model, 1, "mps", False)


def test_auto_picks_cuda_then_mps_then_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setitem(devices.DEVICES, "cuda", dataclasses.replace(devices.DEVICES["cuda"], available=lambda: True))
    assert devices.pick_device("auto") == "cuda"
    monkeypatch.setitem(devices.DEVICES, "cuda", dataclasses.replace(devices.DEVICES["cuda"], available=lambda: False))
    assert devices.pick_device("auto") == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert devices.pick_device("auto") == "cpu"


def test_mps_on_a_machine_without_one_is_one_sentence(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(devices.UserError, match=r"--device=mps but this torch sees no Apple GPU \(MPS\); give"):
        devices.pick_device("mps")


# ----------------------------------------------------------------------------- cancelled in W&B

FAKE_WANDB = ROOT / "tests" / "fake_wandb"  # W&B's client, stood in for (its docstring says how)


def wandb_env(tmp_path, **settings):
    return {"PYTHONPATH": os.pathsep.join([str(FAKE_WANDB), os.environ.get("PYTHONPATH", "")]),
            "FAKE_WANDB_DIR": str(tmp_path), **settings}


def test_a_run_tagged_cancel_in_wandb_stops_with_a_checkpoint_on_two_ranks_and_resumes_bit_exactly(
        data_root, tmp_path):
    common = TINY + [f"--data.data_root={data_root}", "--train.max_steps=16", "--eval.interval=0",
                     "--train.total_batch_size=256",
                     "--model.dropout=0.1", "--checkpoint.interval=0"]
    run_train(common + [f"--train.out_dir={tmp_path / 'full'}"], nproc=2)  # never stopped
    split = common + [f"--train.out_dir={tmp_path / 'split'}", "--log.wandb=true", "--log.wandb_cancel_seconds=0"]
    stopped = run_train(split, nproc=2, env=wandb_env(tmp_path, FAKE_WANDB_CANCEL_AFTER="3"))
    step = find_checkpoints(tmp_path / "split")[-1][0]
    assert f"cancelled in W&B (tag cancel, now removed) after step {step}; the checkpoint is saved" in stopped.stdout
    assert 3 <= step < 16 and read_metrics(tmp_path / "split")[-1]["step"] == step
    assert len(read_trainer_state(tmp_path / "split" / f"step{step}")["rng"]) == 2  # every rank's part
    assert json.loads((tmp_path / "tags.json").read_text()) == []  # the resumed run is not cancelled again
    run_train(split, nproc=2, env=wandb_env(tmp_path))
    losses = {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "split")}
    assert list(losses) == list(range(1, 17))
    assert losses == {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / "full")}  # bit-exact


@pytest.fixture
def fake_wandb(monkeypatch):
    """The stand-in W&B client for one test: imported in its place, and gone again after, so a later
    test of this process imports the real one."""
    def wandb_modules():
        return {name: module for name, module in sys.modules.items()
                if name == "wandb" or name.startswith("wandb.")}

    monkeypatch.syspath_prepend(str(FAKE_WANDB))
    real = wandb_modules()
    for name in real:
        del sys.modules[name]
    yield
    for name in wandb_modules():
        del sys.modules[name]
    sys.modules.update(real)


@pytest.mark.parametrize("how, warning", [("down", "W&B's API did not answer (ConnectionError"),
                                          ("offline", "W&B is offline")])
def test_wandb_out_of_reach_is_one_warning_and_the_run_goes_on(data_root, tmp_path, monkeypatch, how, warning,
                                                               fake_wandb):
    for name, value in wandb_env(tmp_path, FAKE_WANDB_API=how, FAKE_WANDB_CANCEL_AFTER="1").items():
        monkeypatch.setenv(name, value)
    if how == "offline":
        monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    result = run_in_process(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}",
                                    "--train.max_steps=5", "--log.wandb=true"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr.count(warning) == 1 and "it goes on" in result.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]


def test_wandb_is_asked_about_the_cancel_tags_at_most_once_every_wandb_cancel_seconds(tmp_path, monkeypatch,
                                                                                     fake_wandb):
    """The Stopper asks at every check (each step by default); the thread puts its questions at least
    log.wandb_cancel_seconds apart, and the run's end cuts the wait short."""
    import time

    import metrics
    import wandb

    for name, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    asked, api = [], wandb.Api
    monkeypatch.setattr(wandb, "Api", lambda: asked.append(time.monotonic()) or api())
    with metrics.WandbCancel(wandb.init(project="p", id="run"), ["cancel"], every=0.5) as cancel:
        deadline = time.monotonic() + 1.7
        while time.monotonic() < deadline:  # a check every 10 ms, as fast steps would make them
            cancel.ask()
            time.sleep(0.01)
        ended = time.monotonic()
    cancel.thread.join(timeout=5)
    assert not cancel.thread.is_alive() and time.monotonic() - ended < 0.4  # not held to the next question
    assert 3 <= len(asked) <= 4 and all(b - a >= 0.49 for a, b in zip(asked, asked[1:])), asked
