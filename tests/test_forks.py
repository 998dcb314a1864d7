"""The forks people make of this trainer, each a real edit to a copy of the project, run as a user runs it.

Each fork trains, stops (train.hard_stop), resumes bit for bit (every logged loss and every final weight equal to
an uninterrupted run's), samples (`sample.py`) and exports (`checkpoint.py export-hf`, whose GPT-2 gives the
fork's own logits, or a one-sentence refusal where GPT-2 has no place for a weight). The edits are the ones the
README's "Fork it" section shows; an edit that no longer applies to the code fails here, naming the line.
"""

import json
import os
import shutil
import subprocess
import sys
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
    # the faster losses have no z-loss: the run found so on its first micro-batch and took forward's own line
    assert "output layer + loss: full logits (the fused loss gives" in resumed.stdout
    run(project, "train.py", *args, *STEPS, "--train.hard_stop=1", f"--train.out_dir={tmp_path / 'off'}")
    assert metrics(tmp_path / "off")[0]["train/loss"] < metrics(run_dir)[0]["train/loss"]  # the term is there
    # An applied setting: a resume may change it, and the change is recorded.
    run(project, "train.py", *args, *STEPS[1:], "--train.max_steps=7", "--model.z_loss=2e-3",
        f"--train.out_dir={run_dir}")
    changes = [json.loads(line) for line in (run_dir / "config_changes.jsonl").read_text().splitlines()]
    assert changes[-1]["changes"]["model.z_loss"] == [1e-3, 2e-3]
    samples(project, run_dir)
    exports_with_its_logits(project, run_dir, tmp_path / "hf")  # the z-loss shapes training, not the logits


# ------------------------------------------------------------------ the loss a run trains is forward's own
# A faster loss (the fused one, the slices) serves only where it gives what forward's own line gives, for the model
# as it trains: checked in training mode on the first micro-batch, before any evaluation, and at each evaluation.

FULL_PATH = "--train.loss_path=full"


def losses(run_dir):
    return [row["train/loss"] for row in metrics(run_dir) if "train/loss" in row]  # (step 0 evaluates only)


def test_a_temperature_written_on_forwards_logits_line_trains_what_the_full_path_trains(tmp_path, args):
    project = fork_of_the_project(tmp_path / "project", (
        "model.py", "        logits = self.logits(x)\n", "        logits = self.logits(x) / 0.5\n"))
    run_dir, resumed = train_stop_resume(project, tmp_path, *args)  # a resume chooses as the straight run
    assert "output layer + loss: full logits (the fused loss gives" in resumed.stdout
    assert "; the slices through `logits` give" in resumed.stdout
    run(project, "train.py", *args, *STEPS, FULL_PATH, f"--train.out_dir={tmp_path / 'full'}")
    assert losses(run_dir) == losses(tmp_path / "full")  # the same line computes both: bit for bit


TRAINING_ONLY_GAIN = ("model.py", "        return self.lm_head(h)\n",
                      "        return self.lm_head(h) * (1.5 if self.training else 1.0)  # a gain in training only\n")


def test_a_logits_that_differs_in_training_is_decided_in_training_mode_with_an_evaluation_at_step_0(tmp_path, args):
    project = fork_of_the_project(tmp_path / "project", TRAINING_ONLY_GAIN)
    first = ["--eval.fixed_steps=[0]", "--train.max_steps=3", "--eval.interval=3", "--train.no_checkpoints=true"]
    sliced = run(project, "train.py", *args, *first, f"--train.out_dir={tmp_path / 'chunked'}")
    assert "output layer + loss: slices through `logits`, 1 per micro-step" in sliced.stdout
    assert "(`logits` is more than a matmul by one weight, and the slices through `logits` gave" in sliced.stdout
    run(project, "train.py", *args, *first, FULL_PATH, f"--train.out_dir={tmp_path / 'full'}")
    assert losses(tmp_path / "chunked") == pytest.approx(losses(tmp_path / "full"), rel=1e-5)


ANNEALED = [("model.py", "        self.apply(self._init_weights)\n",
             "        self.apply(self._init_weights)\n"
             "        self.register_buffer(\"temperature\", torch.ones(()))  # halved after each evaluation\n\n"
             "    def train(self, mode=True):\n"
             "        if mode and not self.training:\n"
             "            self.temperature /= 2\n"
             "        return super().train(mode)\n"),
            ("model.py", "        return self.lm_head(h)\n", "        return self.lm_head(h) / self.temperature\n")]


def test_a_logits_whose_state_changes_as_it_trains_is_caught_at_the_next_evaluation(tmp_path, args):
    project = fork_of_the_project(tmp_path / "project", *ANNEALED)
    steps = ["--train.max_steps=4", "--eval.interval=2", "--train.no_checkpoints=true"]
    result = run(project, "train.py", *args, *steps, f"--train.out_dir={tmp_path / 'chunked'}")
    assert "output layer + loss: fused" in result.stdout  # a temperature of 1 at start: a plain matmul
    warned = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith("warning: at step 2, the fused loss gives"), result.stderr
    assert warned[0].endswith("forward's own line computes the loss from step 3 on.")
    run(project, "train.py", *args, *steps, FULL_PATH, f"--train.out_dir={tmp_path / 'full'}")
    assert losses(tmp_path / "chunked") == pytest.approx(losses(tmp_path / "full"), rel=1e-5)


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


# ----------------------------------------------------------------------------- forks that every tool must ask
# Each fork below is a GPT of one's own (train.model_module), or an edit of model.py, that GPT-2's layout does not
# show: every tool must ask the model (its `logits`, `score_tokens`, parameter kinds) to get it right. Each trains,
# resumes, evaluates a task (in the run), samples, runs a ladder dry run and exports, or is refused in one sentence.

SOFT_CAP = """import torch, model
class GPT(model.GPT):
    def logits(self, h):  # Gemma 2's soft-cap: 30 * tanh(logits / 30), and no new weight
        return 30 * torch.tanh(super().logits(h) / 30)
"""
RELU_MLP = """import torch.nn as nn, model
class GPT(model.GPT):
    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        for block in self.blocks:
            block.mlp.gelu = nn.ReLU()  # another function, the same weights
"""
OUTPUT_GAIN = """import torch, torch.nn as nn, model
class GPT(model.GPT):
    # a learned gain before the output layer, a kind of parameter of its own: not in N, AdamW without decay
    param_kinds = {**model.PARAM_KINDS, "gain": model.ParamKind(in_n=False, muon=False, decay=False)}
    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        self.out_gain = nn.Parameter(torch.ones(config.n_embd))
    def logits(self, h):
        return super().logits(h * self.out_gain)
    def param_groups(self):
        groups = super().param_groups()
        groups["vector"] = [p for p in groups["vector"] if p is not self.out_gain]
        return {**groups, "gain": [self.out_gain]}
"""


NO_LM_HEAD = """import torch.nn.functional as F

import model


class GPT(model.GPT):
    \"\"\"Tied output through the token embedding itself, with no lm_head module: the counts find the output layer
    through `logits` (num_params_with_output), not by its name.\"\"\"

    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        del self.lm_head

    def logits(self, h):
        return F.linear(h, self.transformer.wte.weight)
"""


def ladder_file(tmp_path, data_root, *lines, size="1x64"):
    path = tmp_path / "ladder_of_the_fork.py"
    path.write_text("\n".join([f'ladder.name = "fork"', f'ladder.dir = "{tmp_path / "ladder"}"',
                               f'ladder.sizes = ["{size}"]',
                               "ladder.batch_tokens = 256", "ladder.duration_tokens = 8192",
                               "ladder.chinchilla_multiple = 1", "ladder.warmup_tokens = 512",
                               "model.block_size = 32", f'data.data_root = "{data_root}"', *lines]) + "\n")
    return path


def tools_on_the_fork(tmp_path, args, run_dir, ladder_lines):
    """The task evaluated in the run, a sample, the ladder's N: what every tool gives for the fork (in this process)."""
    import ladder
    from checkpoint import load_model
    from conftest import run_in_process
    from sample import generate_text

    rows = metrics(run_dir)
    assert "eval/hellaswag/acc" in rows[-1]  # scored through the fork's score_tokens, in the run
    model = load_model(str(run_dir), "cpu", "the fork", model_module=ladder_lines[0].split('"')[1])
    generator = torch.Generator().manual_seed(0)
    text, = generate_text(model, "ROMEO:", num_samples=1, max_new_tokens=4, temperature=1.0, top_k=0, device="cpu",
                          generator=generator)
    assert text.startswith("ROMEO:") and len(text) > len("ROMEO:")
    file = ladder_file(tmp_path, args[-1].split("=", 1)[1], *ladder_lines)
    planned = run_in_process(["dry-run", file, "--json"], ladder.main)
    assert planned.returncode == 0, planned.stderr
    return model, json.loads(planned.stdout.splitlines()[0])


def exported_or_refused(model, folder, refusal):
    """export-hf's result: GPT-2 with the fork's own logits, or (refusal) one sentence and no folder."""
    pytest.importorskip("transformers", reason="export-hf needs transformers (pip install transformers)")
    from lab import hf
    from config import UserError

    if refusal is None:
        hf.export_hf(model, str(folder))  # which checks the logits itself
        assert (folder / "config.json").exists()
        return
    with pytest.raises(UserError) as refused:
        hf.export_hf(model, str(folder))
    sentence = str(refused.value)
    assert refusal in sentence and "\n" not in sentence and sentence.endswith(".")
    assert not folder.exists() and not any(p.name.startswith(f".{folder.name}.") for p in folder.parent.iterdir())


@pytest.mark.parametrize("source, refusal", [(SOFT_CAP, "differ by up to"), (RELU_MLP, "differ by up to"),
                                             (OUTPUT_GAIN, "has no place for (out_gain"), (NO_LM_HEAD, None)],
                         ids=["soft-cap", "relu-mlp", "parameter-kind", "no-lm-head"])
def test_a_gpt_of_your_own_trains_resumes_evaluates_samples_is_laddered_and_exported_or_refused(
        tmp_path, args, source, refusal):
    from conftest import run_train, tiny_task_data

    module = tmp_path / "my_gpt.py"
    module.write_text(source)
    run_dir = tmp_path / "run"
    own = [f"--train.model_module={module}", "--train.max_steps=3", "--checkpoint.interval=2", "--eval.interval=3",
           "--eval.tasks=hellaswag", "--eval.tasks_interval=3", "--eval.tasks_limit=2",
           f"--eval.tasks_data_dir={tiny_task_data()}",
           f"--train.out_dir={run_dir}"]
    run_train([*args[:-1], *own, "--train.hard_stop=2", args[-1]])
    resumed = run_train([*args[:-1], *own, args[-1]])
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    model, plan = tools_on_the_fork(tmp_path, args, run_dir, [f'train.model_module = "{module}"'])
    from configurator.model import param_counts, sized_model
    from model import GPTConfig
    assert plan["non_embedding_params"] == param_counts(sized_model("1x64", GPTConfig(block_size=32), str(module)))[
        "non_embedding"]
    if source is NO_LM_HEAD:  # the same model as model.py's, counted the same without the name lm_head
        from model import GPT
        assert model.num_params_with_output() == GPT(model.config).num_params_with_output() == \
            model.num_params(non_embedding=True) + 50304 * 32
    if source is OUTPUT_GAIN:  # its kind of its own: not in N, and AdamW's group without decay
        from config import OptimConfig
        from optimizer import param_groups
        assert model.num_params() - model.num_params(non_embedding=True) == 50304 * 32 + 32 * 32 + 32
        assert any(p is model.out_gain for p in param_groups(model, OptimConfig())["no_decay"])
    exported_or_refused(model, tmp_path / "hf", refusal)


def test_a_bias_on_the_output_layer_is_counted_with_it_outside_n_and_adds_no_matmul_flops():
    """An lm_head with bias=True: its bias is part of the output layer (kind output_vector: no decay, no Muon), not
    one of N's vectors, and multiplies nothing, so N and the FLOPs are those of the model without it."""
    import model

    class WithOutputBias(model.GPT):
        def __init__(self, config, loss_path="chunked"):
            super().__init__(config, loss_path)
            self.lm_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=True)
            self.lm_head.weight = self.transformer.wte.weight  # tied, as GPT-2

    config = model.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
    plain, biased = model.GPT(config), WithOutputBias(config)
    assert [p is biased.lm_head.bias for p in biased.param_groups()["output_vector"]] == [True]
    assert biased.num_params() == plain.num_params() + config.vocab_size  # counted, with the output layer
    assert biased.num_params(non_embedding=True) == plain.num_params(non_embedding=True)  # not in N
    assert biased.flops_per_token() == plain.flops_per_token()  # a bias is no matmul


def test_a_kind_of_parameter_the_table_does_not_list_is_one_sentence_naming_it(tmp_path, args):
    from conftest import run_train

    module = tmp_path / "my_gpt.py"
    module.write_text(OUTPUT_GAIN.replace("    param_kinds = ", "    unused = "))
    refused = run_train([*args, f"--train.model_module={module}", f"--train.out_dir={tmp_path / 'run'}"], check=False)
    assert_one_sentence(refused, "puts out_gain under the kind 'gain'", "model.PARAM_KINDS")
    assert not (tmp_path / "run").exists()


STACKED_VALUE_EMBEDDINGS = """import torch
import torch.nn as nn

import model


class GPT(model.GPT):
    \"\"\"Value embeddings as one 3-D parameter (a table per layer), added to the final hidden states here only to
    use it: param_groups cannot tell a stack of lookup tables from a stack of matrices.\"\"\"

    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        self.value_embeds = nn.Parameter(torch.zeros(config.n_layer, config.vocab_size, config.n_embd))
"""


RENAMED_OUTPUT = """import torch.nn as nn

import model


class GPT(model.GPT):
    \"\"\"An untied output layer under a name of its own: the output layer is what `logits` multiplies by.\"\"\"

    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        del self.lm_head
        self.unembed = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def logits(self, h):
        return self.unembed(h)
"""


def test_an_output_layer_by_another_name_is_the_output_whole_and_sharded(tmp_path):
    """param_groups found the output layer as `lm_head`: `unembed` was a matrix, and Muon stepped it (exit 0, another
    model). Now it is the output, to AdamW, as what `logits` multiplies by; FSDP's sharded pieces (one gloo rank
    here) are answered by the names fsdp.shard read while the weights were whole."""
    module = tmp_path / "my_gpt.py"
    module.write_text(RENAMED_OUTPUT)
    script = f"""
import os, sys, torch.distributed as dist
sys.path.insert(0, {str(ROOT)!r})
from config import OptimConfig
from checkpoint import gpt_class
from model import GPTConfig
from optimizer import param_groups
from lab.fsdp import shard
GPT = gpt_class({str(module)!r})
def answers(m):
    return (m.num_params_with_output(), m.flops_per_token(),
            [name for name, p in m.named_parameters() if any(p is q for q in m.param_groups()["output"])])
whole = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))
assert not any(p is whole.unembed.weight for p in param_groups(whole, OptimConfig(name="muon"))["muon"])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", rank=0, world_size=1)
sharded = shard(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)), bf16=False, compiled=False)
assert type(sharded.unembed.weight).__name__ == "DTensor"
print(answers(whole), answers(sharded))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    whole, sharded = result.stdout.strip().split(") (")
    assert whole + ")" == "(" + sharded and "['unembed.weight']" in whole, result.stdout


def test_a_parameter_of_more_than_two_dimensions_is_refused_by_muon_unless_its_kind_says_so(tmp_path, args):
    """A 3-D parameter counts as a matrix (a stack of them, or a conv kernel), which Muon cannot step: under Muon it
    was a traceback from torch.optim.Muon, and is one sentence naming it. Given a kind of its own (a table per
    layer: not in N, AdamW without decay), the run trains under Muon."""
    from conftest import run_train
    from checkpoint import gpt_class
    from model import GPT, GPTConfig

    module = tmp_path / "my_gpt.py"
    module.write_text(STACKED_VALUE_EMBEDDINGS)
    refused = run_train([*args, f"--train.model_module={module}", "--optim.name=muon",
                         f"--train.out_dir={tmp_path / 'run'}"], check=False)
    assert_one_sentence(refused, "optim.name=muon steps value_embeds, a 3-D parameter", "Muon steps matrices only")
    assert not (tmp_path / "run").exists()
    module.write_text(STACKED_VALUE_EMBEDDINGS + """
    param_kinds = {**model.PARAM_KINDS, "table": model.ParamKind(in_n=False, muon=False, decay=False)}

    def param_groups(self):
        groups = super().param_groups()
        groups["matrix"] = [p for p in groups["matrix"] if p is not self.value_embeds]
        return {**groups, "table": [self.value_embeds]}
""")
    run_train([*args, f"--train.model_module={module}", "--optim.name=muon", "--train.max_steps=2",
               "--eval.interval=0", f"--train.out_dir={tmp_path / 'run'}"])
    own = gpt_class(str(module))(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))
    assert own.num_params(non_embedding=True) == GPT(own.config).num_params(non_embedding=True)


GQA = [("model.py", "    n_embd: int = field(",
        "    # key and value heads (grouped-query attention, Ainslie et al. 2023); 0: as many as n_head\n"
        "    n_kv_head: int = field(default=0, metadata={\"role\": \"identity\", \"ladder\": False, "
        "\"check\": \"0 or more\"})\n    n_embd: int = field("),
       ("model.py", "        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)",
        "        self.n_kv_head = config.n_kv_head or config.n_head\n"
        "        self.kv_width = self.n_kv_head * config.n_embd // config.n_head\n"
        "        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * self.kv_width, bias=config.bias)"),
       ("model.py", "        q, k, v = self.c_attn(x).split(C, dim=2)\n",
        "        q, k, v = self.c_attn(x).split([C, self.kv_width, self.kv_width], dim=2)\n"),
       ("model.py", "        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)\n"
                    "        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)",
        "        k, v = (t.view(B, T, self.n_kv_head, C // self.n_head).transpose(1, 2) for t in (k, v))\n"
        "        k, v = (t.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for t in (k, v))")]


def test_grouped_query_attention_with_a_new_identity_field_serves_every_tool(tmp_path, args):
    """An edit of model.py (a new field, n_kv_head, beside the model's config): trains, resumes, samples, is laddered
    with the fork's N (fewer key and value heads, fewer parameters), and export-hf refuses it in one sentence."""
    from conftest import tiny_task_data

    project = fork_of_the_project(tmp_path / "project", *GQA)
    run_dir = tmp_path / "run"
    gqa = ["--model.n_kv_head=1", "--train.max_steps=3", "--checkpoint.interval=2", f"--train.out_dir={run_dir}",
           "--eval.tasks=hellaswag", "--eval.tasks_interval=3", "--eval.tasks_limit=2",
           f"--eval.tasks_data_dir={tiny_task_data()}"]
    run(project, "train.py", *args, *gqa, "--train.hard_stop=2")
    resumed = run(project, "train.py", *args, *gqa)
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    assert weights(run_dir / "step3")["transformer.h.0.attn.c_attn.weight"].shape == (32 + 2 * 16, 32)
    assert "eval/hellaswag/acc" in metrics(run_dir)[-1]
    samples(project, run_dir)
    file = ladder_file(tmp_path, args[-1].split("=", 1)[1], size="1x128")  # two 64-wide heads
    n = json.loads(run(project, "ladder.py", "dry-run", file, "--json", "--model.n_kv_head=1").stdout)
    from configurator.model import param_counts, sized_model
    from model import GPTConfig
    all_heads = param_counts(sized_model("1x128", GPTConfig(block_size=32)))["non_embedding"]  # n_kv_head = n_head
    assert n["non_embedding_params"] == all_heads - 2 * 64 * (128 + 1)  # a key and a value head fewer, with biases
    pytest.importorskip("transformers", reason="export-hf needs transformers (pip install transformers)")
    refused = run(project, "checkpoint.py", "export-hf", run_dir, tmp_path / "hf", check=False)
    # in this model's orientation (out, in), as its weights print, not GPT-2's Conv1D one
    assert_one_sentence(refused, "transformer.h.0.attn.c_attn.weight is (64, 32) where a Hugging Face GPT-2's is "
                                 "(96, 32)")
    assert not (tmp_path / "hf").exists()


# ----------------------------------------------------------------------------- forks whose fast paths compute otherwise
# Two forks that train right and are served wrong by a path faster than model(idx): sampling's KV cache, the tasks'
# packed score_tokens. Each tool checks its fast path once against the plain forward: sample.py and
# hellaswag_eval.py refuse in one sentence, and the loop warns once and turns the path's output off.

ROPE_FROM_THE_CACHE = """import torch
import torch.nn.functional as F

import model


def rotate(t, pos):
    \"\"\"Rotary position embedding (Su et al. 2021) of queries or keys (B, heads, T, head size) at `pos`.\"\"\"
    half = t.size(-1) // 2
    angles = pos[:, None].float() / 10000 ** (torch.arange(half, device=t.device) / half)
    a, b = t[..., :half], t[..., half:]
    return torch.cat([a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()], -1)


class Attention(model.CausalSelfAttention):
    def forward(self, x, kv_cache=None, attn_mask=None):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        start = 0 if kv_cache is None else kv_cache.length  # the next position, as the first layer reads it
        pos = torch.arange(start, start + T, device=x.device)
        q, k = rotate(q, pos), rotate(k, pos)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        if attn_mask is None:
            attn_mask = torch.ones(T, k.size(2), dtype=torch.bool, device=x.device).tril(k.size(2) - T)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class GPT(model.GPT):
    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        for block in self.blocks:
            block.attn.__class__ = Attention
            # Ten times GPT-2's initial scale: a tiny model two steps old then attends by position, as a
            # trained one does (at GPT-2's scale its attention is near uniform, and positions barely matter).
            for linear in (block.attn.c_attn, block.attn.c_proj):
                torch.nn.init.normal_(linear.weight, std=0.2)
"""
# The same fork as one writes it, at GPT-2's initial scale: attention barely depends on position at first.
ROPE_AT_GPT2_SCALE = ROPE_FROM_THE_CACHE.replace(
    "            for linear in (block.attn.c_attn, block.attn.c_proj):\n"
    "                torch.nn.init.normal_(linear.weight, std=0.2)\n", "")
assert ROPE_AT_GPT2_SCALE != ROPE_FROM_THE_CACHE
SOFT_CAP_IN_FORWARD = """import torch
import torch.nn.functional as F

import model


class GPT(model.GPT):
    def forward(self, idx, targets=None, kv_cache=None):  # a soft-cap here, where `logits` does not see it
        logits = torch.tanh(self.logits(self.hidden_states(idx, kv_cache)))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
"""


def train_checking_fast_paths(tmp_path, args, source, steps):
    """Train the GPT file `source` with samples and a task scored at every step, so the loop checks their fast
    paths each time: (the file, the run folder, the run's output, its warnings)."""
    from conftest import run_train, tiny_task_data

    module = tmp_path / "my_gpt.py"
    module.write_text(source)
    run_dir = tmp_path / "run"
    trained = run_train([*args[:-1], f"--train.model_module={module}", f"--train.max_steps={steps}",
                         "--eval.interval=0", "--eval.tasks=hellaswag", "--eval.tasks_interval=1",
                         "--eval.tasks_limit=2", f"--eval.tasks_data_dir={tiny_task_data()}",
                         "--eval.sample_interval=1", "--eval.sample_tokens=2", f"--train.out_dir={run_dir}",
                         args[-1]])
    warnings = [line for line in trained.stderr.splitlines() if line.startswith("warning:")]
    return module, run_dir, trained, warnings


@pytest.mark.parametrize("source, refused_by, turned_off", [
    (ROPE_FROM_THE_CACHE, {"sample.py": "make its forward with kv_cache compute what it computes without",
                           "hellaswag_eval.py": "give the fork a score_tokens"}, ("tasks", "samples")),
    (SOFT_CAP_IN_FORWARD, {"hellaswag_eval.py": "give the fork a score_tokens"}, ("tasks",))],
    ids=["rope-from-the-cache", "soft-cap-in-forward"])
def test_a_fork_whose_fast_path_computes_otherwise_is_refused_by_the_tools_and_warned_of_in_the_loop(
        tmp_path, args, source, refused_by, turned_off):
    import hellaswag_eval
    import sample
    from conftest import run_in_process, tiny_task_data

    module, run_dir, trained, warnings = train_checking_fast_paths(tmp_path, args, source, steps=2)
    assert [line.rsplit("; ", 1)[1] for line in warnings] == [f"{what} are off for this run." for what in turned_off]
    assert not any(key.startswith("eval/") for row in metrics(run_dir) for key in row)  # no task scored
    assert ("--- step" in trained.stdout) == ("samples" not in turned_off)
    mains = {"sample.py": (sample.main, ["--max_new_tokens=2", "--num_samples=1"]),
             "hellaswag_eval.py": (hellaswag_eval.main, [f"--data_dir={tiny_task_data()}", "--limit=2"])}
    for tool, (main, extra) in mains.items():
        result = run_in_process([f"--init_from={run_dir}", "--device=cpu", f"--model_module={module}", *extra], main)
        if tool in refused_by:
            assert_one_sentence(result, "than its plain forward model(idx)", refused_by[tool])
        else:
            assert result.returncode == 0 and result.stdout.startswith("--- sample 0"), result.stderr


def test_a_rope_fork_at_gpt2_scale_is_refused_by_the_tools_and_warned_of_when_its_fast_path_drifts(tmp_path, args):
    """The RoPE fork as one writes it, at GPT-2's initial scale: its fast paths are off by 1e-4 to 1e-3, far above
    float noise and below the old 1e-4-of-the-scale tolerance. The loop checks them at every evaluation and
    sampling, so a path that passes at first is turned off where it drifts; the tools refuse the run's weights."""
    import hellaswag_eval
    import sample
    from conftest import run_in_process, tiny_task_data

    module, run_dir, trained, warnings = train_checking_fast_paths(tmp_path, args, ROPE_AT_GPT2_SCALE, steps=6)
    assert {line.rsplit("; ", 1)[1] for line in warnings} == {"samples are off for this run.",
                                                              "tasks are off for this run."}, trained.stderr
    tasks_off = int(next(line for line in warnings if line.endswith("tasks are off for this run."))
                    .split(",")[0].split()[-1])
    scored = [row["step"] for row in metrics(run_dir) if "eval/hellaswag/acc" in row]
    assert scored == list(range(1, tasks_off)), (scored, tasks_off)  # scored until the check found it off
    for main, extra, phrase in [
            (sample.main, ["--max_new_tokens=2", "--num_samples=1"], "make its forward with kv_cache"),
            (hellaswag_eval.main, [f"--data_dir={tiny_task_data()}", "--limit=2"], "give the fork a score_tokens")]:
        result = run_in_process([f"--init_from={run_dir}", "--device=cpu", f"--model_module={module}", *extra], main)
        assert_one_sentence(result, "than its plain forward model(idx)", phrase)


DRIFTING_FAST_PATHS = """import torch, model
class GPT(model.GPT):
    \"\"\"Fast paths right until the model has been evaluated once, then off by `drift`: a stand-in for a fork
    whose fast paths drift from its forward as it trains.\"\"\"
    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        self.register_buffer("drift", torch.zeros(()), persistent=False)
    def train(self, mode=True):
        if mode and not self.training:
            self.drift += 1e-3
        return super().train(mode)
    def forward(self, idx, targets=None, kv_cache=None):
        out = super().forward(idx, targets, kv_cache)
        if kv_cache is not None:
            out[..., 0] += self.drift
        return out
    def score_tokens(self, idx, targets, *args, **kwargs):
        return super().score_tokens(idx, targets, *args, **kwargs) + self.drift * (targets != -1)
"""


def test_the_loop_checks_its_fast_paths_each_time_it_takes_them(tmp_path, args):
    from conftest import run_train, tiny_task_data

    module = tmp_path / "my_gpt.py"
    module.write_text(DRIFTING_FAST_PATHS)
    run_dir = tmp_path / "run"
    trained = run_train([*args[:-1], f"--train.model_module={module}", "--train.max_steps=3", "--eval.interval=0",
                         "--eval.tasks=hellaswag", "--eval.tasks_interval=1", "--eval.tasks_limit=2",
                         f"--eval.tasks_data_dir={tiny_task_data()}", "--eval.sample_interval=1",
                         "--eval.sample_tokens=2", f"--train.out_dir={run_dir}", args[-1]])
    warnings = [line for line in trained.stderr.splitlines() if line.startswith("warning:")]
    assert [line.split(",")[0] for line in warnings] == ["warning: at step 1", "warning: at step 2"], trained.stderr
    assert warnings[1].endswith("tasks are off for this run.")  # its first check passed, its second did not
    assert [row["step"] for row in metrics(run_dir) if "eval/hellaswag/acc" in row] == [1]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_on_two_ranks_the_loop_warns_once_turns_both_fast_paths_off_and_the_ranks_agree(tmp_path, args, parallel):
    """The RoPE fork on 2 gloo ranks: every rank checks the tasks' path (each scores a share of the examples), and
    under FSDP every rank checks the samples' too (each runs the same forwards). Rank 0 warns once per path; the run
    ends with no rank waiting at a collective the others skipped."""
    from conftest import run_train, tiny_task_data

    module = tmp_path / "my_gpt.py"
    module.write_text(ROPE_FROM_THE_CACHE)
    run_dir = tmp_path / "run"
    trained = run_train([*args, f"--train.model_module={module}", "--train.max_steps=2", "--eval.interval=0",
                         "--train.total_batch_size=256", f"--train.data_parallel={parallel}", "--eval.tasks=hellaswag",
                         "--eval.tasks_interval=1", "--eval.tasks_limit=4", f"--eval.tasks_data_dir={tiny_task_data()}",
                         "--eval.sample_interval=1", "--eval.sample_tokens=2", f"--train.out_dir={run_dir}"],
                        nproc=2, timeout=300)
    warnings = [line for line in trained.stderr.splitlines() if line.startswith("warning:")]
    assert [line.rsplit("; ", 1)[1] for line in warnings] == ["tasks are off for this run.",
                                                              "samples are off for this run."], trained.stderr
    assert all("plain forward" in line for line in warnings)
    assert [row["step"] for row in metrics(run_dir)] == [1, 2]
    assert not any(key.startswith("eval/") for row in metrics(run_dir) for key in row)
    assert "--- step" not in trained.stdout and not (run_dir / "samples.txt").exists()
