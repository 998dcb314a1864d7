"""The advertised command's code path, on this CPU: what config/gpt2.py turns on with a GPU
(torch.compile with inductor, really compiled; bfloat16 autocast; train.loss_path=full, which auto
picks under compile on CUDA; fused AdamW) run for real, in small, so CI keeps it alive without a GPU.
A compiled bf16 run with evaluation, samples and checkpoints, its resume, the same in float32
resumed bit for bit, no recompilation after the first step and evaluation, sampling and task
scoring from its checkpoint, and DDP and FSDP compiled on 2 gloo ranks. The runs are made once for
the module, on one pytest worker, so inductor's cache serves every compile after the first."""

import pytest
import torch

import hellaswag_eval
import sample
import train
from conftest import TINY, read_metrics, run_in_process, run_train
from hellaswag_fixture import write_hellaswag

pytestmark = pytest.mark.xdist_group("compiled")

# The CUDA row's choices, forced on the CPU: compile, bf16, the full-logits loss. Dropout, so that a
# resume must put the random state back; evaluation, samples and a checkpoint at step 3 and the end.
GPU_PATH = TINY + ["--model.n_embd=64", "--model.block_size=64", "--train.compile=true",
                   "--train.loss_path=full", "--model.dropout=0.1", "--train.max_steps=6",
                   "--train.total_batch_size=512", "--eval.interval=3", "--eval.val_steps=2",
                   "--checkpoint.interval=3", "--eval.sample_interval=3", "--eval.sample_tokens=8",
                   "--eval.num_samples=1"]
BF16 = "--train.dtype=bfloat16"
FP32 = "--train.dtype=float32"


def losses(out):
    return {r["step"]: r["train/loss"] for r in read_metrics(out) if "train/loss" in r}


def graphs_compiled():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory):
    """Inductor's compiled kernels in a folder of the module's own (every process of it: torchrun's ranks
    inherit the setting), not the system temp folder, which the suite leaves as it found it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


@pytest.fixture(scope="module")
def runs(data_root, tmp_path_factory, inductor_cache):
    """{name: (run folder, output)}: each run in this process, with whether AdamW was fused (the
    CUDA row's choice, and the CPU's) and the number of graphs compiled at each step's end and each
    evaluation's."""
    base = tmp_path_factory.mktemp("compiled")
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        fused = []
        build_optimizer = train.build_optimizer
        patch.setattr(train, "build_optimizer",
                      lambda *args: fused.append(args[2]) or build_optimizer(*args))
        graphs = []
        train_step, evaluate = train.train_step, train.evaluate
        patch.setattr(train, "train_step", lambda *a, **k: (train_step(*a, **k),
                                                            graphs.append(("step", graphs_compiled())))[0])
        patch.setattr(train, "evaluate", lambda *a, **k: (evaluate(*a, **k),
                                                          graphs.append(("eval", graphs_compiled())))[0])
        for name, extra in (("bf16", [BF16]), ("bf16_split", [BF16, "--train.hard_stop=3"]),
                            ("bf16_split", [BF16]), ("fp32", [FP32]),
                            ("fp32_split", [FP32, "--train.hard_stop=3"]), ("fp32_split", [FP32])):
            graphs.clear()
            out = base / name
            result = run_in_process(GPU_PATH + extra + [f"--data.data_root={data_root}",
                                                        f"--train.out_dir={out}"])
            assert result.returncode == 0, result.stdout + result.stderr
            found[name] = (out, result.stdout)
            found[f"{name} graphs"] = list(graphs)
        found["fused"] = fused
    return found


def test_a_compiled_bf16_run_evaluates_samples_saves_and_logs_its_compile_time(runs):
    out, stdout = runs["bf16"]
    assert "; torch.compile" in stdout and "full" in stdout  # the start line: compiled, full logits
    assert "compiling included" in stdout and all(runs["fused"])  # the CUDA row's fused AdamW
    rows = read_metrics(out)
    assert next(r for r in rows if r["step"] == 1)["throughput/compile_time_sec"] > 0
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "val/loss" in r] == [3, 6]
    assert (out / "step3").is_dir() and (out / "step6").is_dir()
    samples = (out / "samples.txt").read_text()
    assert "--- step 3, sample 0" in samples and "--- step 6, sample 0" in samples
    assert losses(out)[6] < losses(out)[1]  # it learns


def test_nothing_compiles_again_after_the_first_step_and_evaluation(runs):
    graphs = runs["bf16 graphs"]
    kinds = [kind for kind, _ in graphs]
    first_eval = kinds.index("eval")
    assert kinds.count("eval") == 2 and kinds.count("step") == 6
    settled = graphs[first_eval][1]
    assert settled > 0  # inductor compiled graphs, for training and for evaluation
    assert all(count == settled for _, count in graphs[first_eval:]), graphs


def test_a_compiled_float32_run_resumes_bit_for_bit(runs):
    (out, stdout), straight = runs["fp32_split"], losses(runs["fp32"][0])
    split = losses(out)
    assert "at step 3" in stdout
    assert sorted(split) == [1, 2, 3, 4, 5, 6]
    assert all(split[step] == straight[step] for step in (4, 5, 6))


def test_a_compiled_bf16_run_resumes_to_the_same_losses_within_bf16s_noise(runs):
    straight, split = losses(runs["bf16"][0]), losses(runs["bf16_split"][0])
    assert sorted(split) == [1, 2, 3, 4, 5, 6]
    assert all(abs(split[step] - straight[step]) < 1e-2 for step in (4, 5, 6))


def test_a_compiled_runs_checkpoint_samples_and_is_scored(runs, tmp_path):
    out = runs["bf16"][0]
    sampled = run_in_process([f"--init_from={out}", "--num_samples=2", "--max_new_tokens=8",
                              "--device=cpu"], sample.main)
    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stdout + sampled.stderr
    data = write_hellaswag(tmp_path / "hellaswag.jsonl")
    scored = run_in_process([f"--init_from={out}", f"--data={data}", "--device=cpu", "--json"],
                            hellaswag_eval.main)
    assert scored.returncode == 0 and '"acc"' in scored.stdout, scored.stdout + scored.stderr


def test_ddp_with_compile_and_bf16_trains_on_two_gloo_ranks_as_one_process_does(runs, data_root,
                                                                                 tmp_path):
    out = tmp_path / "ddp"
    run_train(GPU_PATH + [BF16, f"--data.data_root={data_root}", f"--train.out_dir={out}",
                          "--train.max_steps=3", "--eval.interval=0", "--eval.sample_interval=0",
                          "--checkpoint.interval=0"], nproc=2)
    two, one = losses(out), losses(runs["bf16"][0])
    assert sorted(two) == [1, 2, 3]
    # the same tokens per step, split over two ranks: one process's losses within bf16's noise
    assert all(abs(two[step] - one[step]) < 5e-2 for step in two)


def test_fsdp_with_compile_and_bf16_trains_and_resumes_on_two_gloo_ranks(data_root, tmp_path):
    common = GPU_PATH + [BF16, f"--data.data_root={data_root}", "--train.data_parallel=fsdp",
                         "--eval.sample_interval=0", "--train.max_steps=4", "--checkpoint.interval=2",
                         "--eval.interval=2"]
    run_train(common + [f"--train.out_dir={tmp_path / 'straight'}"], nproc=2)
    assert (tmp_path / "straight" / "step4" / "sharded").is_dir()
    run_train(common + [f"--train.out_dir={tmp_path / 'split'}", "--train.hard_stop=2"], nproc=2)
    resumed = run_train(common + [f"--train.out_dir={tmp_path / 'split'}"], nproc=2)
    assert "at step 2" in resumed.stdout
    straight, split = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert sorted(split) == [1, 2, 3, 4]
    assert all(abs(split[step] - straight[step]) < 1e-2 for step in (3, 4))
