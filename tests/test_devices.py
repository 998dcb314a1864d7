"""The device table (devices.py), and Apple silicon stood in for: no machine here has one, so torch's MPS
checks and calls are replaced by fakes and the tensors stay on this CPU. The quick start's config runs
through every branch of the MPS row, and nothing CUDA-only is called. Then a run cancelled from W&B,
whose client is stood in for too (tests/fake_wandb/)."""

import contextlib
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
    assert "torch.compile" not in result.stdout and "fused in" in result.stdout  # compile off: the fused loss
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


NO_LIMIT_V1 = "9223372036854771712"  # what cgroup v1's memory.limit_in_bytes holds without a limit


@pytest.mark.parametrize("files, left", [
    # cgroup v2: the process's own cgroup, less the file cache the kernel drops first; "max" is no limit
    ({"proc/self/cgroup": "0::/kubepods/pod1\n", "sys/kubepods/memory.max": "max",
      "sys/kubepods/pod1/memory.max": f"{4 * GIB}", "sys/kubepods/pod1/memory.current": f"{3 * GIB}",
      "sys/kubepods/pod1/memory.stat": f"anon 5\ninactive_file {GIB}\n"}, 2 * GIB),
    # a parent's limit holds its children: the smallest headroom counts
    ({"proc/self/cgroup": "0::/slurm/job7\n", "sys/slurm/memory.max": f"{3 * GIB}",
      "sys/slurm/memory.current": f"{2 * GIB}", "sys/slurm/job7/memory.max": f"{2 * GIB}"}, GIB),
    # cgroup v1: the memory hierarchy's line; the root's "no limit" is a huge number
    ({"proc/self/cgroup": "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n0::/\n",
      "sys/memory/memory.limit_in_bytes": NO_LIMIT_V1, "sys/memory/docker/abc/memory.limit_in_bytes": f"{GIB}",
      "sys/memory/docker/abc/memory.usage_in_bytes": f"{GIB // 4}"}, 3 * GIB // 4),
    # a container that sees its own cgroup as the root, under the host's path
    ({"proc/self/cgroup": "3:memory:/docker/abc\n", "sys/memory/memory.limit_in_bytes": f"{GIB}"}, GIB),
    ({"proc/self/cgroup": "0::/user.slice\n", "sys/user.slice/memory.max": "max"}, None),
    ({"proc/self/cgroup": "3:memory:/\n", "sys/memory/memory.limit_in_bytes": NO_LIMIT_V1}, None),
    ({"proc/self/cgroup": "0::/gone\n3:memory:/gone\n"}, None),  # the files it names are missing
    ({"proc/self/cgroup": "0::/\n", "sys/memory.max": "lots"}, None),  # unreadable as a number
    ({}, None),  # no /proc
])
def test_the_memory_check_reads_the_limit_of_the_processs_cgroup(tmp_path, files, left):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert devices.cgroup_memory_left(str(tmp_path / "proc"), str(tmp_path / "sys")) == left


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


@pytest.mark.parametrize("name", list(devices.DEVICES))
def test_every_row_hands_the_loop_a_function_wherever_the_loop_calls_one(name):
    """The entries the loop calls on every device are functions on every row (a CPU's clock has
    nothing to wait for, and says so with a function that does nothing); the ones a row may leave
    out (None) are each tested where they are used."""
    row = devices.DEVICES[name]
    for entry in ("available", "count", "prepare", "synchronize", "memory", "autocast_dtype", "peak_flops",
                  "capacity"):
        assert callable(getattr(row, entry)), f"{name}: {entry}"
    assert (row.rng_state is None) == (row.set_rng_state is None)
    assert row.backend in (None, "nccl", "gloo") and row.compiled_loss_path in ("chunked", "full")
    if name == "cpu":  # the compiled first step's timing waits through the row's function
        from metrics import StepClock

        clock = StepClock(row.synchronize, 1, 1, 1, 1, None)
        with clock.paused("eval"):
            pass
        clock.synchronize()


# ---------------------------------------------------------------------- CUDA, stood in for the same way


class RecordedEvent:
    """torch.cuda.Event's stand-in: the metrics' copy to the host records one and waits on it."""

    def __init__(self, calls):
        self.calls = calls

    def record(self):
        self.calls.append("cuda.Event.record")

    def synchronize(self):
        self.calls.append("cuda.Event.synchronize")


@pytest.fixture
def a_gpu(monkeypatch):
    """A machine with one CUDA GPU, whose calls are recorders and whose tensors stay on this CPU, so the
    quick start runs through every entry of the table's CUDA row. Returns the calls made."""
    calls = []
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(cuda, "mem_get_info",  # (free, total): the check that the weights fit reads it
                        lambda device=None: calls.append("cuda.mem_get_info") or (70 * GIB, 80 * GIB))
    monkeypatch.setattr(cuda, "synchronize", lambda device=None: calls.append("cuda.synchronize"))
    monkeypatch.setattr(cuda, "Event", lambda: RecordedEvent(calls))
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: 3 * GIB)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: 5 * GIB)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: 4 * GIB)
    monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": torch.tensor([9], dtype=torch.uint8))
    monkeypatch.setattr(cuda, "set_rng_state",
                        lambda state, device="cuda": calls.append(f"cuda.set_rng_state {state.tolist()}"))
    monkeypatch.setattr(cuda, "set_device", lambda device: calls.append(f"cuda.set_device {device}"))
    for name in ("manual_seed", "manual_seed_all"):  # (torch.manual_seed seeds every GPU too)
        monkeypatch.setattr(cuda, name, lambda seed, name=name: calls.append(f"cuda.{name}"))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the row sets it; put back after
    monkeypatch.setitem(devices.DEVICES, "cuda", dataclasses.replace(  # (the row holds torch's functions)
        devices.DEVICES["cuda"], available=cuda.is_available, count=cuda.device_count,
        synchronize=cuda.synchronize, copy_event=cuda.Event, set_rng_state=cuda.set_rng_state))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args: calls.append("pinned") or self)
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append("torch.compile") or model)
    start_processes, build_optimizer = train.start_processes, train.build_optimizer

    def on_this_cpu(cfg):  # a GPU's tensors live on this CPU; the placement keeps CUDA's row
        place = start_processes(cfg)
        calls.append(f"placed on {place.device}, autocast {getattr(place.autocast, 'fast_dtype', None)}")
        return dataclasses.replace(place, device="cpu", autocast=contextlib.nullcontext())

    monkeypatch.setattr(train, "start_processes", on_this_cpu)
    monkeypatch.setattr(train, "build_optimizer",
                        lambda *args: calls.append(f"fused {args[2]}") or build_optimizer(*args))
    return calls


def test_the_quick_start_trains_on_a_stand_in_gpu_through_every_entry_of_its_row(a_gpu, data_root, tmp_path):
    out = tmp_path / "run"
    # (metrics on the bookkeeping thread, as with several ranks: their copy to the host uses the row's event)
    common = QUICK_START + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--log.async_bookkeeping=true"]
    result = run_in_process(common)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "placed on cuda, autocast torch.bfloat16" in a_gpu  # auto picks the GPU, and bf16
    assert "torch.compile" in a_gpu and "the first step compiles" in result.stdout  # compile=auto compiles
    assert "output layer + loss: full" in result.stdout  # the loss path auto picks under compile on CUDA
    assert "fused True" in a_gpu and "pinned" in a_gpu and "cuda.mem_get_info" in a_gpu
    assert "compiling included" in result.stdout  # the compiled first step, timed to the GPU's end
    # The clock waits for the GPU around each pause (validation at steps 2 and 4, the checkpoint) and at the
    # end of the compiled first step; each metrics copy records an event and waits for it.
    assert a_gpu.count("cuda.synchronize") == 2 * 3 + 1
    assert a_gpu.count("cuda.Event.record") == a_gpu.count("cuda.Event.synchronize") > 0
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and (out / "step4").is_dir()
    for row in rows:  # memory from CUDA's allocator; MFU against the H100's peak
        assert row["system/gpu_memory_allocated_gb"] == 3.0 and row["system/gpu_memory_peak_gb"] == 4.0
        assert row["throughput/mfu"] > 0
    resumed = run_in_process(common + ["--train.max_steps=5"])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "cuda.set_rng_state [9]" in a_gpu  # the GPU's random state, saved and put back


def test_under_torchrun_a_gpu_rank_hands_nccl_to_the_process_group_and_makes_a_gloo_side_group(
        a_gpu, monkeypatch):
    import torch.distributed as dist

    from config import parse_args

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(29500 + os.getpid() % 1000)}.items():
        monkeypatch.setenv(name, value)
    backends, init = [], dist.init_process_group
    monkeypatch.setattr(dist, "init_process_group",  # NCCL asked for; gloo is what this CPU has
                        lambda backend, **kwargs: backends.append(backend) or init("gloo", **kwargs))
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: backends.append(kwargs["backend"]) or "side")
    try:
        place = train.start_processes(parse_args([]))
    finally:
        dist.destroy_process_group()
    assert backends == ["nccl", "gloo"] and place.cpu_group == "side"  # collectives on the GPU; agreements on gloo
    assert "cuda.set_device cuda:0" in a_gpu and "placed on cuda:0, autocast torch.bfloat16" in a_gpu


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


def test_wandb_that_cannot_start_the_run_is_one_sentence_and_the_run_folder_stays_as_it_was(data_root, tmp_path,
                                                                                            monkeypatch, fake_wandb):
    """W&B starts before the run folder changes: out of reach, a new folder gets no config.json,
    environment.json, wandb_id.txt or wandb/, and a resumed one is left as it was; a resume logs into the same
    W&B run."""
    for name, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    common = TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0", "--log.wandb=true"]

    def files():
        return {path.relative_to(out): path.read_bytes() for path in out.rglob("*") if path.is_file()}

    monkeypatch.setenv("FAKE_WANDB_INIT", "down")
    refused = run_in_process(common + ["--train.max_steps=2"])
    assert_one_sentence(refused, "W&B could not start the run (CommError: Run initialization has timed out",
                        "or log offline with WANDB_MODE=offline")
    assert not out.exists()
    monkeypatch.delenv("FAKE_WANDB_INIT")
    run_in_process(common + ["--train.max_steps=2"])
    run_id, before = (out / "wandb_id.txt").read_text(), files()
    monkeypatch.setenv("FAKE_WANDB_INIT", "down")
    assert_one_sentence(run_in_process(common + ["--train.max_steps=4"]), "W&B could not start the run")
    assert files() == before
    monkeypatch.delenv("FAKE_WANDB_INIT")
    resumed = run_in_process(common + ["--train.max_steps=4"])
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout + resumed.stderr
    assert (out / "wandb_id.txt").read_text() == run_id


def test_wandb_is_asked_about_the_cancel_tags_at_most_once_every_wandb_cancel_seconds(tmp_path, monkeypatch,
                                                                                     fake_wandb):
    """The Stopper asks at every check (each step by default); the thread puts its questions at least
    log.wandb_cancel_seconds apart, and the run's end cuts the wait short. Time is bounded from above
    only: a loaded machine makes the thread slower, never faster."""
    import time

    import metrics
    import wandb

    for name, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    asked, api = [], wandb.Api
    monkeypatch.setattr(wandb, "Api", lambda: asked.append(time.monotonic()) or api())

    def ask_until(cancel, questions):  # a check every 10 ms, as fast steps would make them
        give_up = time.monotonic() + 120
        while len(asked) < questions and time.monotonic() < give_up:
            cancel.ask()
            time.sleep(0.01)

    started = time.monotonic()
    with metrics.WandbCancel(wandb.init(project="p", id="run"), ["cancel"], every=0.2) as cancel:
        ask_until(cancel, 3)
    cancel.thread.join(timeout=60)
    # each question starts at least 0.2 s after the one before, all of them between `started` and now
    assert 3 <= len(asked) <= 1 + (time.monotonic() - started) / 0.2, asked

    asked.clear()
    with metrics.WandbCancel(wandb.init(project="p", id="run"), ["cancel"], every=600) as cancel:
        ask_until(cancel, 1)
        for _ in range(20):  # more checks inside the 600 s: none of them asks again
            cancel.ask()
            time.sleep(0.01)
    cancel.thread.join(timeout=120)
    assert not cancel.thread.is_alive()  # not held to the next question, 600 s away
    assert len(asked) == 1, asked
