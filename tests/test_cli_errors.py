"""Mistakes a user can make on the command line of sample.py, hellaswag_eval.py, bench.py, bench_eval.py,
checkpoint.py export-hf and debug.py: each ends the program with one `error: ...` sentence that says what
to do, exit status 1, no traceback, and nothing written."""

import os

import pytest
import torch

from tools import bench, bench_eval
import checkpoint
from lab import debug
import hellaswag_eval
import sample
from conftest import ROOT, TINY, assert_one_sentence, run_in_process, run_train
from hellaswag_fixture import write_hellaswag
from data import EOT_TOKEN, get_tokenizer

ON_CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that sees no CUDA GPU")


@pytest.fixture(scope="module")
def run_dir(data_root, tmp_path_factory):
    """A run folder with one checkpoint of a tiny model, for every command here to load."""
    out = tmp_path_factory.mktemp("cli") / "run"
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=1",
                      "--optim.warmup_steps=1"])
    return out


# ----------------------------------------------------------------------------- --device


def device_commands(run_dir, tmp_path):
    """{name: (main, arguments besides --device)} of the commands that take a --device, each otherwise valid."""
    data = str(write_hellaswag(tmp_path / "h.jsonl", copies=1))
    return {"sample": (sample.main, [f"--init_from={run_dir}", "--num_samples=1", "--max_new_tokens=2"]),
            "hellaswag_eval": (hellaswag_eval.main, [f"--init_from={run_dir}", f"--data={data}"]),
            "bench_eval": (bench_eval.main, [f"--init_from={run_dir}", f"--data={data}", "--limit=1", "--repeats=1"])}


@pytest.mark.parametrize("device, message", [
    pytest.param("cuda", "--device=cuda but this torch sees no CUDA GPU; give --device=cpu.", marks=ON_CPU_ONLY,
                 id="cuda"),
    pytest.param("foo", "--device=foo is not a device; give auto, cpu, mps, cuda or cuda:N.", id="foo"),
    pytest.param("cuda:x", "--device=cuda:x is not a device; give auto, cpu, mps, cuda or cuda:N.", id="cuda:x"),
])
@pytest.mark.parametrize("command", ["sample", "hellaswag_eval", "bench_eval"])
def test_a_device_that_is_not_here_is_one_sentence_before_a_model_loads(run_dir, tmp_path, command, device, message):
    main, args = device_commands(run_dir, tmp_path)[command]
    assert_one_sentence(run_in_process(args + [f"--device={device}"], main), message)


# ----------------------------------------------------------------------------- sample.py


@pytest.mark.parametrize("temperature", ["nan", "inf", "-1"])
def test_sample_refuses_a_temperature_that_is_not_a_finite_number_of_zero_or_more(run_dir, temperature):
    result = run_in_process([f"--init_from={run_dir}", f"--temperature={temperature}", "--num_samples=1",
                             "--max_new_tokens=2", "--device=cpu"], sample.main)
    assert_one_sentence(result, f"--temperature={float(temperature)} is out of range", "give a finite value")


def test_an_empty_prompt_starts_from_end_of_text_and_prints_only_the_generated_text(run_dir):
    result = run_in_process([f"--init_from={run_dir}", "--prompt=", "--temperature=0", "--num_samples=1",
                             "--max_new_tokens=4", "--device=cpu"], sample.main)
    assert result.returncode == 0, result.stderr
    model = checkpoint.load_model(str(run_dir), "cpu", "--init_from")
    new = sample.generate(model, torch.tensor([[EOT_TOKEN]]), 4, temperature=0)[0, 1:].tolist()  # as GPT-2 starts
    new = new[: new.index(EOT_TOKEN)] if EOT_TOKEN in new else new
    assert result.stdout == f"--- sample 0\n{get_tokenizer().decode(new)}\n"
    beams = run_in_process([f"--init_from={run_dir}", "--prompt=", "--beam_size=2", "--max_new_tokens=4",
                            "--device=cpu"], sample.main)
    assert beams.returncode == 0 and beams.stdout.count("--- beam") == 2, beams.stderr
    assert "<|endoftext|>" not in beams.stdout


# ----------------------------------------------------------------------------- bench.py and bench_eval.py


@pytest.mark.parametrize("steps", [5, 10, 0])
def test_bench_refuses_too_few_steps_to_time_before_writing_data(tmp_path, steps):
    result = run_in_process([f"--steps={steps}", f"--data_root={tmp_path / 'data'}"], bench.main)
    assert_one_sentence(result, f"--steps={steps} leaves no step to time", "give --steps=11 or more.")
    assert not (tmp_path / "data").exists()


def test_bench_refuses_a_nanogpt_folder_that_is_not_a_clone_before_writing_into_it(tmp_path):
    result = run_in_process([f"--nanogpt={tmp_path / 'missing'}", "--steps=11", f"--data_root={tmp_path / 'data'}"],
                            bench.main)
    assert_one_sentence(result, f"--nanogpt={tmp_path / 'missing'} is not a clone of karpathy/nanoGPT", "give ")
    assert not (tmp_path / "missing").exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize("sizes", ["abc", "1,,16", "16,0", ""])
def test_bench_eval_refuses_batch_sizes_that_are_not_positive_whole_numbers(run_dir, tmp_path, sizes):
    result = run_in_process([f"--init_from={run_dir}", f"--data={write_hellaswag(tmp_path / 'h.jsonl', copies=1)}",
                             "--limit=1", "--repeats=1", "--device=cpu", f"--batch_sizes={sizes}"], bench_eval.main)
    assert_one_sentence(result, f"--batch_sizes={sizes} is not", "give ")


# ----------------------------------------------------------------------------- checkpoint.py export-hf, debug.py


def test_export_hf_refuses_an_empty_output_folder_before_loading_or_writing(run_dir):
    pytest.importorskip("transformers")
    result = run_in_process(["export-hf", str(run_dir), ""], checkpoint.main)  # in ROOT, where "" would land
    assert_one_sentence(result, "give a new folder to export into.")
    assert not any((ROOT / name).exists() for name in ("config.json", "model.safetensors", "vocab.json"))


@pytest.mark.parametrize("top", [-1, 0])
def test_compare_state_refuses_a_top_below_one(run_dir, top):
    result = run_in_process(["compare-state", str(run_dir), str(run_dir), f"--top={top}"], debug.main)
    assert_one_sentence(result, f"--top={top} lists no tensor", "give --top=1 or more.")


def test_every_error_a_user_can_cause_is_a_user_error():
    import config
    import data
    import metrics
    from lab import hf

    for error in (config.ConfigError, data.DataError, checkpoint.CheckpointError, hellaswag_eval.TaskDataError,
                  metrics.NonFiniteLoss, hf.WeightsError, metrics.SinkError, debug.DebugError):
        assert issubclass(error, config.UserError), error


# ----------------------------------------------------------------------------- URLs of other stores

def test_a_url_of_a_store_checkpoints_are_not_kept_in_is_one_sentence(data_root, tmp_path):
    """An ftp:// folder would make fsspec try to log in to the host (a gaierror traceback offline)."""
    import train

    url = "ftp://example.invalid/run"
    assert_one_sentence(run_in_process(["--init_from", url], sample.main), url, "s3://, gs:// or file://")
    out = tmp_path / "run"
    result = run_in_process([*TINY, f"--data.data_root={data_root}", f"--train.out_dir={out}",
                             f"--checkpoint.remote_folder={url}"], train.main)
    assert_one_sentence(result, f"checkpoint.remote_folder={url}", "not ftp://")
    assert not out.exists()


def test_a_model_whose_weights_cannot_fit_the_device_is_one_sentence_before_it_is_built(data_root, tmp_path):
    """model.block_size=1e8 asks for a 51 GB table of positions: an allocation traceback once."""
    import train

    out = tmp_path / "run"
    result = run_in_process([*TINY, "--model.block_size=100000000", "--model.n_embd=128",
                             f"--data.data_root={data_root}", f"--train.out_dir={out}"], train.main)
    assert_one_sentence(result, "block_size=100000000", "for its weights alone", "make it smaller")
    assert not out.exists()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="measures the process through Linux's /proc")
def test_weights_that_fit_the_machine_but_not_the_process_are_one_sentence_before_they_are_built(data_root, tmp_path):
    """The check reads what this process can get, not the machine's total: under `ulimit -v` (RLIMIT_AS) a 6 GB
    position table (block_size=12e6) is refused in one sentence, not left to an allocation traceback."""
    import subprocess
    import sys

    out = tmp_path / "run"
    argv = ["train.py", *TINY, "--model.block_size=12000000", "--model.n_embd=128", "--train.device=cpu",
            f"--data.data_root={data_root}", f"--train.out_dir={out}"]
    limited = ("import resource, runpy, sys, torch\n"  # the limit: 3 GiB beyond what torch maps on this machine
               "mapped = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
               "resource.setrlimit(resource.RLIMIT_AS, (mapped + 3 * 2**30, resource.RLIM_INFINITY))\n"
               f"sys.argv = {argv!r}\nrunpy.run_path('train.py', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", limited], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert_one_sentence(result, "block_size=12000000", "for its weights alone", "this process can get on this CPU",
                        "make it smaller")
    assert not out.exists()


def test_weights_that_fit_the_machine_but_not_the_container_are_one_sentence_before_they_are_built(
        data_root, tmp_path, monkeypatch):
    """A container's memory limit (its cgroup's) is what the process can get, whatever /proc/meminfo says of the
    host: weights above it are refused in one sentence, with nothing written."""
    import devices
    import train

    monkeypatch.setattr(devices, "cgroup_memory_left", lambda: 10**6)  # 1 MB; the weights need about 7 MB
    out = tmp_path / "run"
    result = run_in_process([*TINY, "--train.device=cpu", f"--data.data_root={data_root}",
                             f"--train.out_dir={out}"], train.main)
    assert_one_sentence(result, "for its weights alone, more than the 0.0 GB this process can get on this CPU",
                        "make it smaller")
    assert not out.exists()
