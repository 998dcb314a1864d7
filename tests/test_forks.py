"""The forks people make of this trainer, each a real edit to a copy of the project, run as a user runs it.

Each fork trains, stops (train.hard_stop), resumes bit for bit (every logged loss and every final weight equal to
an uninterrupted run's), samples (`sample.py`) and exports (`checkpoint.py export-hf`, whose GPT-2 gives the
fork's own logits, or a one-sentence refusal where GPT-2 has no place for a weight). The edits are the ones the
README's "Fork it" section shows; an edit that no longer applies to the code fails here, naming the line.
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import warm_python
from conftest import ROOT, TINY, assert_one_sentence

STEPS = ["--train.max_steps=6", "--eval.interval=3", "--checkpoint.interval=3", "--eval.sample_interval=0"]
# What a fork's copy needs: the trainer, its config files and tools (not the tests, docs, course or data).
NOT_COPIED = shutil.ignore_patterns(".git", "tests", "docs", "exercises", "data", "out", "__pycache__", ".bench",
                                    "*.png")


def fork_of_the_project(folder, *edits):
    """A copy of the project in `folder` with `edits` made (see make_edits)."""
    shutil.copytree(ROOT, folder, ignore=NOT_COPIED)
    return make_edits(folder, *edits)


def make_edits(folder, *edits):
    """Each edit is (file, text that must be there exactly once, its replacement)."""
    for name, old, new in edits:
        path = folder / name
        text = path.read_text()
        assert text.count(old) == 1, f"{name} no longer holds, once, the text this fork edits: {old!r}"
        path.write_text(text.replace(old, new))
    return folder


def run(project, *args, check=True):
    """`python ARGS` in the fork's folder, as a user runs it there (a process of its own, started warm:
    warm_python.py), with the fork's own modules."""
    result = warm_python.python(args, project, {**os.environ, "OMP_NUM_THREADS": "1"})
    if check:
        assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def metrics(run_dir):
    """The run's rows, one per step (a late row of a step, such as its checkpoint's time, merged in)."""
    from metrics import read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl")


def weights(checkpoint):
    return torch.load(checkpoint / "model.pt", map_location="cpu", weights_only=True)


def train_stop_resume(project, out, *args):
    """Train 6 steps straight, and 3 + 3 with a stop between: every logged loss and final weight must be equal.
    Returns (the stopped-and-resumed run's folder, the resume's output)."""
    run(project, "train.py", *args, *STEPS, f"--train.out_dir={out / 'straight'}")
    run(project, "train.py", *args, *STEPS, f"--train.out_dir={out / 'stopped'}", "--train.hard_stop=3")
    resumed = run(project, "train.py", *args, *STEPS, f"--train.out_dir={out / 'stopped'}")
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout, resumed.stdout
    straight, stopped = metrics(out / "straight"), metrics(out / "stopped")
    assert [r["step"] for r in stopped] == [r["step"] for r in straight] == [1, 2, 3, 4, 5, 6]
    for key in ("train/loss", "train/grad_norm", "val/loss"):
        assert [r.get(key) for r in stopped] == [r.get(key) for r in straight], key
    a, b = weights(out / "straight" / "step6"), weights(out / "stopped" / "step6")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    return out / "stopped", resumed


def samples(project, run_dir):
    result = run(project, "sample.py", f"--init_from={run_dir}", "--prompt=ROMEO:", "--num_samples=1",
                 "--max_new_tokens=8", "--device=cpu")
    assert result.stdout.startswith("--- sample 0\nROMEO:") and len(result.stdout.splitlines()) >= 2
    return result


def exports_with_its_logits(project, run_dir, folder):
    """export-hf, then GPT-2 in transformers gives the fork's own logits (over GPT-2's 50,257 tokens). The last part of
    each fork's test: without transformers the fork has trained, resumed and sampled, and the export is skipped."""
    transformers = pytest.importorskip("transformers", reason="export-hf needs transformers (pip install transformers)")

    run(project, "checkpoint.py", "export-hf", run_dir, folder)
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(idx, folder / "idx.pt")
    run(project, "-c", "import sys, torch, checkpoint; m = checkpoint.load_model(sys.argv[1], 'cpu', 'the fork'); "
                       "torch.save(m(torch.load(sys.argv[2]))[..., :50257], sys.argv[3])",
        run_dir, folder / "idx.pt", folder / "ours.pt")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        assert torch.allclose(theirs(idx).logits, torch.load(folder / "ours.pt"), atol=1e-4)
    return theirs


@pytest.fixture()
def args(data_root):
    return [*TINY, f"--data.data_root={data_root}"]


def test_an_untied_output_layer_saves_resumes_and_exports_its_own_weights(tmp_path, args):
    project = fork_of_the_project(tmp_path / "project", (
        "model.py", "        self.transformer.wte.weight = self.lm_head.weight\n", ""))
    run_dir, resumed = train_stop_resume(project, tmp_path, *args, "--optim.decay_embeddings=false")
    saved = weights(run_dir / "step6")
    assert not torch.equal(saved["lm_head.weight"], saved["transformer.wte.weight"])  # two weights, both saved
    tied_params = 1_636_224  # TINY's tied GPT, as the unforked trainer prints it
    assert f"model: {tied_params + 50304 * 32:,} parameters" in resumed.stdout  # read from the model
    samples(project, run_dir)
    hf = exports_with_its_logits(project, run_dir, tmp_path / "hf")
    assert not hf.config.tie_word_embeddings


def test_no_position_table_trains_with_nothing_outside_model_py_edited(tmp_path, args):
    project = fork_of_the_project(
        tmp_path / "project",
        ("model.py", "                wpe=nn.Embedding(config.block_size, config.n_embd),\n", ""),
        ("model.py", "self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))",
         "self.transformer.drop(self.transformer.wte(idx))"))
    # Per-layer gradient norms and Muon too: they ask the model which parameters are what.
    run_dir, resumed = train_stop_resume(project, tmp_path, *args, "--log.grad_norms_interval=1",
                                         "--optim.name=muon")
    assert not any("wpe" in name for name in weights(run_dir / "step6"))
    assert "grad/layer01" in metrics(run_dir)[0] and "grad/embedding" in metrics(run_dir)[0]
    assert "(25,472 non-embedding)" in resumed.stdout  # the blocks' parameters, as with a position table
    samples(project, run_dir)
    exports_with_its_logits(project, run_dir, tmp_path / "hf")  # GPT-2 with zero position embeddings


def test_a_new_parameter_in_block_trains_and_a_checkpoint_from_before_the_edit_is_refused(tmp_path, args):
    project = fork_of_the_project(tmp_path / "project")
    before = tmp_path / "before"
    run(project, "train.py", *args, *STEPS, f"--train.out_dir={before}", "--train.hard_stop=3")
    gain = "        self.gain = nn.Parameter(torch.ones(config.n_embd))  # a learned gain on attention's output\n"
    make_edits(project, ("model.py", "        self.mlp = MLP(config)\n", "        self.mlp = MLP(config)\n" + gain),
               ("model.py", "        x = x + self.attn(self.ln_1(x), kv_cache, attn_mask)",
                "        x = x + self.gain * self.attn(self.ln_1(x), kv_cache, attn_mask)"))
    listed = sorted(os.listdir(before))
    stamps = {name: (before / name).stat().st_mtime_ns for name in listed}
    refused = run(project, "train.py", *args, *STEPS, f"--train.out_dir={before}", check=False)
    assert_one_sentence(refused, "do not fit this model", "transformer.h.0.gain is not in it",
                        "a new train.out_dir", "--checkpoint.load=never --checkpoint.save_overwrite=true")
    assert sorted(os.listdir(before)) == listed and all((before / n).stat().st_mtime_ns == t for n, t in stamps.items())
    run_dir, _ = train_stop_resume(project, tmp_path, *args)
    gains = [tensor for name, tensor in weights(run_dir / "step6").items() if name.endswith(".gain")]
    assert len(gains) == 2 and not torch.equal(gains[0], torch.ones(32))  # saved by name, and trained
    samples(project, run_dir)
    pytest.importorskip("transformers", reason="export-hf needs transformers (pip install transformers)")
    refused = run(project, "checkpoint.py", "export-hf", run_dir, tmp_path / "hf", check=False)
    assert_one_sentence(refused, "a Hugging Face GPT-2 has no place for", "transformer.h.0.gain")
    assert not (tmp_path / "hf").exists()


Z_LOSS = [("model.py", "    dropout: float = field(",
           "    # PaLM's z-loss: this times the mean squared log-normalizer of the logits joins the loss (0: off)\n"
           "    z_loss: float = field(default=0.0, metadata={\"role\": \"applied\", \"ladder\": False, "
           "\"check\": \"0 or more\"})\n    dropout: float = field("),
          ("model.py", "        self.loss_path = loss_path  #",
           "        self.loss_path = \"full\" if config.z_loss else loss_path  #"),  # the chunked loss has no z-loss
          ("model.py", "        return F.cross_entropy(",
           "        z = self.config.z_loss * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()\n"
           "        return z + F.cross_entropy(")]


def test_a_new_setting_used_by_the_model_is_declared_once_checked_and_resumes(tmp_path, args):
    project = fork_of_the_project(tmp_path / "project", *Z_LOSS)
    help_text = run(project, "train.py", "--help").stdout
    assert "--model.z_loss=0.0" in help_text and "PaLM's z-loss" in help_text  # its comment is its --help
    assert_one_sentence(run(project, "train.py", *args, "--model.z_loss=-1", check=False),
                        "model.z_loss must be 0 or more")
    run_dir, resumed = train_stop_resume(project, tmp_path, *args, "--model.z_loss=1e-3")
    assert "output layer + loss: full" in resumed.stdout  # read from the model, which took the full path
    run(project, "train.py", *args, *STEPS, "--train.hard_stop=1", f"--train.out_dir={tmp_path / 'off'}")
    assert metrics(tmp_path / "off")[0]["train/loss"] < metrics(run_dir)[0]["train/loss"]  # the term is there
    # An applied setting: a resume may change it, and the change is recorded.
    run(project, "train.py", *args, *STEPS[1:], "--train.max_steps=7", "--model.z_loss=2e-3",
        f"--train.out_dir={run_dir}")
    changes = [json.loads(line) for line in (run_dir / "config_changes.jsonl").read_text().splitlines()]
    assert changes[-1]["changes"]["model.z_loss"] == [1e-3, 2e-3]
    samples(project, run_dir)
    exports_with_its_logits(project, run_dir, tmp_path / "hf")  # the z-loss shapes training, not the logits


def setting(option):
    """A config file's line for a command-line option: --optim.name=adamw -> optim.name = "adamw"."""
    key, value = option[2:].split("=", 1)
    return f"{key} = {value if value.replace('.', '').isdigit() else repr(value)}"


def test_your_own_folder_of_text_files_is_the_data(tmp_path, data_root):
    texts = tmp_path / "my_texts"
    (texts / "more").mkdir(parents=True)
    for i, source in enumerate(sorted(Path(os.__file__).parent.glob("*.py"))[:40]):
        (texts / ("more" if i % 2 else "") / f"{source.stem}.txt").write_text(source.read_text(encoding="utf-8"))
    project = fork_of_the_project(tmp_path / "project")
    (project / "config" / "mine.py").write_text(
        "# My own texts: `python prepare_data.py text my_texts --out_dir data/mine` prepared them.\n"
        'data.dataset = "mine"\n' + "".join(f"{setting(line)}\n" for line in TINY))
    prepared = run(project, "prepare_data.py", "text", texts, "--out_dir", tmp_path / "data" / "mine")
    assert "text: 40 documents" in prepared.stdout
    run_dir, _ = train_stop_resume(project, tmp_path, "config/mine.py", f"--data.data_root={tmp_path / 'data'}")
    assert metrics(run_dir)[-1]["val/loss"] < metrics(run_dir)[2]["val/loss"]  # it learns the texts
    samples(project, run_dir)
    exports_with_its_logits(project, run_dir, tmp_path / "hf")
