"""Fine-tuning OpenAI's GPT-2 with train.py (checkpoint.load_path=gpt2|...|a HF folder), offline.

The GPT-2 here is a small seeded random one that `transformers` writes with save_pretrained: the same
format and loading code as OpenAI's, without the download.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import warm_python
from conftest import ROOT, TINY, read_metrics, run_in_process, run_train

transformers = pytest.importorskip("transformers")

# TINY's shape, with a longer context than the run's 32 (the run crops it) and GPT-2's own vocabulary.
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**SHAPE)).save_pretrained(folder)
    return folder


def finetune(data_root, out, source, *extra):
    return TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", f"--checkpoint.load_path={source}",
                   "--train.max_steps=6", "--optim.warmup_steps=1", "--eval.fixed_steps=0", "--eval.interval=6",
                   *extra]


def test_step_0_val_loss_is_the_transformers_models_loss_and_training_lowers_it(data_root, gpt2_folder, tmp_path):
    from data import TokenLoader, dataset_dir

    result = run_train(finetune(data_root, tmp_path / "run", gpt2_folder))
    assert f"starting from the weights of {gpt2_folder}" in result.stdout
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    assert rows[1]["tokens"] == 128  # step 0 of a fresh run, not a resume
    # The same val batches the trainer read (val_steps=2 micro-batches of 4 x 32), through the HF model.
    hf = transformers.GPT2LMHeadModel.from_pretrained(gpt2_folder).eval()
    loader = TokenLoader(dataset_dir(str(data_root), "shakespeare"), "val", batch_size=4, block_size=32,
                         vocab_size=50257)
    with torch.no_grad():
        losses = [F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()) for x, y in
                  (loader.next_batch() for _ in range(2))]
    assert rows[0]["val/loss"] == pytest.approx(torch.stack(losses).mean().item(), abs=1e-5)
    assert rows[6]["val/loss"] < rows[0]["val/loss"] - 0.01  # fine-tuning moved it


def test_a_shape_the_weights_do_not_have_is_one_sentence_and_nothing_is_written(data_root, gpt2_folder, tmp_path):
    for wrong, field in (("--model.n_layer=3", "model.n_layer=3"), ("--model.block_size=128", "never grow"),
                         ("--model.vocab_size=50000", "model.vocab_size=50000")):
        result = run_train(finetune(data_root, tmp_path / "run", gpt2_folder, wrong), check=False)
        assert result.returncode == 1 and "Traceback" not in result.stderr and field in result.stderr, wrong
        assert not (tmp_path / "run").exists()


def test_resuming_a_fine_tune_is_exact_and_needs_the_source_no_more(data_root, gpt2_folder, tmp_path):
    run_train(finetune(data_root, tmp_path / "whole", gpt2_folder))
    source = tmp_path / "gpt2-tiny"  # a copy, deleted before the resume (as a hub name offline, not cached)
    source.mkdir()
    for name in os.listdir(gpt2_folder):
        (source / name).write_bytes((gpt2_folder / name).read_bytes())
    run_train(finetune(data_root, tmp_path / "halves", source, "--train.hard_stop=3"))
    for name in os.listdir(source):
        os.remove(source / name)
    os.rmdir(source)
    resumed = run_train(finetune(data_root, tmp_path / "halves", source))
    assert "resumed from" in resumed.stdout and "is ignored because" in resumed.stdout
    losses = [[r["train/loss"] for r in read_metrics(tmp_path / run) if r["step"] > 0] for run in ("whole", "halves")]
    assert len(losses[0]) == 6 and losses[0] == losses[1]


def test_the_fine_tuned_export_gives_our_checkpoints_logits(data_root, gpt2_folder, tmp_path):
    import checkpoint

    run_train(finetune(data_root, tmp_path / "run", gpt2_folder, "--train.max_steps=2", "--eval.fixed_steps="))
    exported = run_in_process(["export-hf", str(tmp_path / "run"), str(tmp_path / "hf")], checkpoint.main)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 50257
    ours = checkpoint.load_model(str(tmp_path / "run"), "cpu", "--init_from")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x).logits, atol=1e-5)


def test_init_from_on_train_py_says_to_use_checkpoint_load_path(tmp_path):
    result = run_in_process(["--init_from=gpt2"])
    assert result.returncode == 1 and "--checkpoint.load_path=gpt2" in result.stderr
    (tmp_path / "nanogpt_style.py").write_text("init_from = 'gpt2'\n")
    result = run_in_process([str(tmp_path / "nanogpt_style.py")])
    assert result.returncode == 1 and "checkpoint.load_path" in result.stderr


def test_a_gpt2_name_goes_through_the_hub_download_path(data_root, gpt2_folder, tmp_path):
    """`gpt2` loads through transformers' hub code; here its cache is filled from the local folder, offline."""
    snapshot = tmp_path / "hf_home" / "hub" / "models--gpt2" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in os.listdir(gpt2_folder):
        (snapshot / name).write_bytes((gpt2_folder / name).read_bytes())
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [ROOT / "train.py", *finetune(data_root, tmp_path / "run", "gpt2", "--train.max_steps=1")]
    result = warm_python.python(command, ROOT, env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting from the weights of gpt2" in result.stdout
    first = [r for r in read_metrics(tmp_path / "run") if r["step"] == 0][0]["val/loss"]
    local = run_train(finetune(data_root, tmp_path / "local", gpt2_folder, "--train.max_steps=1"))
    assert local.returncode == 0
    assert first == [r for r in read_metrics(tmp_path / "local") if r["step"] == 0][0]["val/loss"]


def test_the_default_config_files_shape_is_named_as_the_reason_for_a_refusal(gpt2_folder, tmp_path):
    result = run_in_process([f"--checkpoint.load_path={gpt2_folder}", f"--train.out_dir={tmp_path / 'run'}"])
    assert result.returncode == 1 and "in config/shakespeare.py, the default config file" in result.stderr
    assert "python train.py config/finetune_shakespeare.py" in result.stderr and not (tmp_path / "run").exists()


def test_a_stage_2_reference_is_checked_against_the_shape_the_weights_give(data_root, gpt2_folder, tmp_path):
    """The fine-tune's shape comes from checkpoint.load_path; stage2.reference was checked before it was applied,
    against the default block_size of 1024, and refused a reference the run could use."""
    args = ["config/finetune_shakespeare.py", f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}",
            f"--checkpoint.load_path={gpt2_folder}", f"--stage2.reference={gpt2_folder}", "--stage2.start=2steps",
            "--stage2.kl_beta=0.1", "--stage2.mix=shakespeare:1", "--train.max_steps=3", "--data.batch_size=2",
            "--train.total_batch_size=128", "--eval.interval=0", "--eval.sample_interval=0", "--eval.fixed_steps=0"]
    run_train(args)
    assert "train/kl" in {row["step"]: row for row in read_metrics(tmp_path / "run")}[3]


def test_a_reference_of_another_tokenizer_is_one_sentence(gpt2_folder):
    """A character-level run (82 characters) with GPT-2 as its reference computed a KL against a model reading
    character ids as GPT-2 tokens, with exit 0."""
    from checkpoint import CheckpointError
    from model import GPTConfig
    from lab.stage2 import check_reference

    check_reference(str(gpt2_folder), GPTConfig(block_size=64), "full")  # GPT-2's tokens, padded: the same
    with pytest.raises(CheckpointError, match=r"predicts 50257, and this run's model.block_size is 64 and its "
                                              r"model.vocab_size 82; give a reference trained on this run's"):
        check_reference(str(gpt2_folder), GPTConfig(block_size=64, vocab_size=82), "nll_diff")


def test_a_character_reference_needs_the_runs_characters_and_for_the_full_kl_exactly_them(monkeypatch):
    """nll_diff scores this run's ids with the reference, so a reference of more characters serves; the full KL
    compares whole distributions, so it needs as many."""
    from lab import stage2
    from checkpoint import CheckpointError
    from config import Config, config_to_dict
    from model import GPTConfig

    saved = Config()
    saved.model = GPTConfig(block_size=64, vocab_size=128)
    monkeypatch.setattr(stage2, "check_source", lambda source, key: source)
    monkeypatch.setattr(stage2, "read_trainer_state", lambda path: {"config": config_to_dict(saved)})
    monkeypatch.setattr(stage2, "check_weights_fit", lambda *args: None)
    stage2.check_reference("ref", GPTConfig(block_size=64, vocab_size=82), "nll_diff")
    with pytest.raises(CheckpointError, match="predicts 128, and this run's model.block_size is 64"):
        stage2.check_reference("ref", GPTConfig(block_size=64, vocab_size=82), "full")
    with pytest.raises(CheckpointError, match="predicts 128"):
        stage2.check_reference("ref", GPTConfig(block_size=64, vocab_size=200), "nll_diff")


def test_fine_tuning_gpt2_under_fsdp_is_one_sentence_before_anything_is_written(data_root, gpt2_folder, tmp_path):
    """GPT-2's weights are copied into a whole model; into FSDP's pieces it was a traceback after the start."""
    from conftest import assert_one_sentence

    refused = run_train(finetune(data_root, tmp_path / "run", gpt2_folder, "--train.data_parallel=fsdp"), check=False)
    assert_one_sentence(refused, "is GPT-2's weights, which load into a whole model, and train.data_parallel=fsdp")
    assert not (tmp_path / "run").exists()
