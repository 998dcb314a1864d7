"""The CUDA paths, for real: skipped without a GPU (CPU CI stays green and says so), run by
`python bench_gpu.py` on a lent GPU before it measures anything."""

import subprocess
import sys

import pytest
import torch
from torch.nn import functional as F

import hellaswag_eval
from config import OptimConfig
from conftest import ROOT, TINY, read_metrics, run_train
from hellaswag_fixture import tiny_model, write_hellaswag
import model
from model import GPT, GPTConfig, LinearCrossEntropy, choose_fast_loss, chunked_cross_entropy
from optimizer import build_optimizer
from sample import generate_text

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def shards(request):
    """The Shakespeare shards `bench_gpu.py --prepare` wrote (a GPU machine may lack the package that
    makes them), else the suite's own."""
    prepared = ROOT / ".bench" / "data"
    return prepared if (prepared / "shakespeare").is_dir() else request.getfixturevalue("data_root")


def small_model(loss_path="chunked", seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64), loss_path).cuda()


def batches(steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    # Ids drawn from the first 100 tokens: a distribution the model learns in a few steps.
    return [torch.randint(0, 100, (8, 65), generator=generator).cuda() for _ in range(steps)]


def train_losses(net, data, bf16):
    optimizer = build_optimizer(net, OptimConfig(lr=3e-3), fused=True)
    losses = []
    for batch in data:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = net(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("loss_path", ["chunked", "full"])
def test_bf16_compiled_training_falls_and_agrees_with_float32_eager(loss_path):
    data = batches(8)
    first = data[0][:, :-1], data[0][:, 1:]
    reference = small_model(loss_path)
    choose_fast_loss(reference, *first)  # as train.py decides it, on the first micro-batch
    assert reference.fast_loss == {"chunked": "fused", "full": ""}[loss_path]
    eager = train_losses(reference, data, bf16=False)
    fast = small_model(loss_path)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        choose_fast_loss(fast, *first, compiled=True)
    assert fast.fast_loss == {"chunked": "sliced", "full": ""}[loss_path]  # bf16's noise is within the check's
    compiled = train_losses(torch.compile(fast), data, bf16=True)
    assert compiled[-1] < compiled[0] - 0.5  # it learns
    for a, b in zip(compiled, eager):
        assert a == pytest.approx(b, rel=2e-2)  # bf16 matmuls: agreement to about a percent


@pytest.mark.parametrize("slice_values", [7 * 50304, 2**29])  # many slices with a ragged last one; the CUDA default
def test_every_loss_path_gives_cross_entropys_loss_and_gradients_on_cuda(monkeypatch, slice_values):
    monkeypatch.setitem(model.LOSS_SLICE_VALUES, "cuda", slice_values)
    torch.manual_seed(0)
    hidden = torch.randn(3000, 64, device="cuda")
    weight = torch.randn(50304, 64, device="cuda") * 0.05
    targets = torch.randint(0, 50257, (3000,), device="cuda")
    targets[::5] = -1

    def full(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-1)

    def fused(h, w, t):
        return LinearCrossEntropy.apply(h, w, t, True)

    def sliced(h, w, t):
        return chunked_cross_entropy(lambda x: F.linear(x, w), h, t, w.size(0))

    results = {}
    for name, fn in (("reference", full), ("fused", fused), ("sliced", sliced)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(h, w, targets)
        loss.backward()
        results[name] = (loss.detach(), h.grad, w.grad)
    for ours, theirs in zip(results["fused"] + results["sliced"], results["reference"] * 2):
        assert torch.linalg.norm(ours - theirs) / torch.linalg.norm(theirs) < 1e-2


def test_nccl_launch_through_torchrun(shards, tmp_path):
    """torchrun with one process: the NCCL process group, DDP and the gloo side group all start."""
    out = tmp_path / "torchrun"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                             str(ROOT / "train.py"), *TINY, f"--data.data_root={shards}", f"--train.out_dir={out}",
                             "--train.max_steps=3", "--train.device=cuda"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 rank(s) on cuda:0" in result.stdout
    assert len([r for r in read_metrics(out) if "train/loss" in r]) == 3


def test_compiled_bf16_run_logs_its_compile_time_saves_async_and_resumes_exactly(shards, tmp_path):
    """config/gpt2.py's settings in small: compiled, bf16, async saves; deterministic mode makes the
    resumed run bit-identical on the GPU."""
    common = TINY + [f"--data.data_root={shards}", "--train.device=cuda", "--train.dtype=bfloat16",
                     "--train.compile=true", "--train.deterministic=true", "--model.dropout=0.1",
                     "--train.max_steps=10", "--eval.interval=5", "--checkpoint.async_save=true",
                     "--checkpoint.interval=3", "--log.metrics_collect_interval=1"]
    full = run_train(common + [f"--train.out_dir={tmp_path / 'full'}"])
    assert "compiling included" in full.stdout
    assert next(r for r in read_metrics(tmp_path / "full") if r["step"] == 1)["throughput/compile_time_sec"] > 0
    run_train(common + [f"--train.out_dir={tmp_path / 'split'}", "--train.hard_stop=6"])
    resumed = run_train(common + [f"--train.out_dir={tmp_path / 'split'}"])
    assert "at step 6" in resumed.stdout
    losses = [{r["step"]: r["train/loss"] for r in read_metrics(tmp_path / run) if "train/loss" in r}
              for run in ("full", "split")]
    assert list(losses[1]) == list(range(1, 11))
    for step in range(7, 11):
        assert losses[1][step] == losses[0][step]  # bit-identical on the GPU in deterministic mode


def test_fsdp_with_bf16_and_compile_trains_as_ddp_does_and_resumes(shards, tmp_path):
    """train.data_parallel=fsdp on one GPU under torchrun: bf16 (gathered in bf16, reduced in fp32), each block
    compiled, a sharded save and its resume; the losses close to DDP's at the same settings."""
    common = TINY + [f"--data.data_root={shards}", "--train.device=cuda", "--train.dtype=bfloat16",
                     "--train.compile=true", "--train.max_steps=6", "--checkpoint.interval=3"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
              str(ROOT / "train.py")]

    def run(out, *extra):
        result = subprocess.run([*launch, *common, f"--train.out_dir={tmp_path / out}", *extra], cwd=ROOT,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return {r["step"]: r["train/loss"] for r in read_metrics(tmp_path / out) if "train/loss" in r}

    ddp = run("ddp")
    fsdp = run("fsdp", "--train.data_parallel=fsdp")
    assert (tmp_path / "fsdp" / "step6" / "sharded").is_dir()
    assert all(abs(ddp[step] - fsdp[step]) < 0.05 for step in ddp)  # bf16 weights in the forward: not bit-equal
    run("split", "--train.data_parallel=fsdp", "--train.hard_stop=3")
    resumed = run("split", "--train.data_parallel=fsdp")
    assert all(abs(resumed[step] - fsdp[step]) < 1e-3 for step in (4, 5, 6))


def test_hellaswag_on_cuda_picks_what_the_cpu_picks(tmp_path):
    examples = {"hellaswag": [hellaswag_eval.encode_example(ex, 64) for ex in
                              hellaswag_eval.load_examples(str(write_hellaswag(tmp_path / "h.jsonl")))]}
    cpu = hellaswag_eval.evaluate_tasks(tiny_model(), examples, "cpu", 4)["hellaswag"]
    gpu = hellaswag_eval.evaluate_tasks(tiny_model().cuda(), examples, "cuda", 4)["hellaswag"]
    assert gpu["acc"] == cpu["acc"] and gpu["acc_norm"] == cpu["acc_norm"]


def test_sampling_on_cuda_is_reproducible_and_decodes():
    net = tiny_model().cuda()
    texts = [generate_text(net, "\n", num_samples=2, max_new_tokens=16, temperature=0.8, top_k=50, device="cuda",
                           generator=torch.Generator("cuda").manual_seed(7)) for _ in range(2)]
    assert texts[0] == texts[1] and all(isinstance(t, str) and t for t in texts[0])
