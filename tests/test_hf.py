"""hf.py: GPT-2 weights in and out of the Hugging Face format, and the folders it refuses in one sentence."""

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lab import hf  # noqa: E402
from checkpoint import load_model  # noqa: E402
from config import UserError  # noqa: E402
import warm_python
from conftest import ROOT, TINY, run_train  # noqa: E402
from data import get_tokenizer  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


@pytest.fixture
def hf_folder(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model


def test_imported_hf_weights_give_the_same_logits(hf_folder):
    path, reference = hf_folder
    ours = load_model(str(path), "cpu", "--init_from")  # --init_from=<local HF folder>
    assert ours.config.vocab_size == 50257 and ours.config.block_size == 64
    x = torch.randint(0, 50257, (2, 40))
    with torch.no_grad():
        assert torch.allclose(ours(x), reference(x).logits, atol=1e-5)


def test_a_half_precision_hf_folder_loads_in_float32_and_is_not_called_a_fork(hf_folder, tmp_path):
    """A folder saved in float16 (transformers 5 loads it in its own dtype): compared with our float32 model in
    float32, it is GPT-2, not "a model that computes otherwise"."""
    path, reference = hf_folder
    reference.half().save_pretrained(tmp_path / "hf16")
    ours = load_model(str(tmp_path / "hf16"), "cpu", "--init_from")
    assert next(ours.parameters()).dtype == torch.float32
    assert torch.equal(ours.transformer.wte.weight, reference.transformer.wte.weight.float())


def test_export_round_trips_through_gpt2lmheadmodel(data_root, tmp_path):
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=2"])
    subprocess.run([sys.executable, "checkpoint.py", "export-hf", str(tmp_path / "run"), str(tmp_path / "export")],
                   cwd=ROOT, check=True, capture_output=True)
    ours = load_model(str(tmp_path / "run"), "cpu", "--init_from")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    assert theirs.config.vocab_size == 50257  # the padded rows are dropped
    x = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert torch.allclose(ours(x)[..., :50257], theirs(x).logits, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    assert tokenizer(text)["input_ids"] == get_tokenizer().encode(text)
    again = load_model(str(tmp_path / "export"), "cpu", "--init_from")  # and back in through --init_from
    with torch.no_grad():
        assert torch.allclose(again(x), theirs(x).logits, atol=1e-5)


def test_export_refuses_a_folder_that_is_not_empty(data_root, tmp_path):
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=1",
                      "--optim.warmup_steps=1"])
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "keep.txt").write_text("mine")
    result = warm_python.python(["checkpoint.py", "export-hf", str(tmp_path / "run"), str(tmp_path / "export")], ROOT)
    assert result.returncode != 0 and "is not empty" in result.stderr
    assert (tmp_path / "export" / "keep.txt").read_text() == "mine"


def test_without_transformers_hf_sources_fail_with_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an uninstalled package looks like
    with pytest.raises(hf.WeightsError, match="needs the transformers package; install it with"):
        hf.import_hf("gpt2")
    with pytest.raises(UserError, match="transformers"):  # checkpoint.py may say so before hf.py is reached
        load_model("gpt2", "cpu", "--init_from")


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("changes, message", [
    ({"n_layer": 3}, "config.json says n_layer=3 but its weights are for n_layer=2"),  # weights lack a layer
    ({"n_layer": 1}, "config.json says n_layer=1 but its weights are for n_layer=2"),  # a layer with no place
    ({"n_embd": 16}, "config.json says n_embd=16 but its weights are for n_embd=32"),
    ({"vocab_size": 50000}, "config.json says vocab_size=50000 but its weights are for vocab_size=50257"),
    ({"n_positions": 32}, "config.json says n_positions=32 but its weights are for n_positions=64"),
    ({"n_head": 3}, "is not a loadable GPT-2 (ValueError: "),  # no GPT-2 has 3 heads of 32 dimensions
])
def test_a_config_json_that_disagrees_with_its_weights_is_one_sentence(hf_folder, changes, message):
    path, _ = hf_folder
    edit_config(path, **changes)
    with pytest.raises(hf.WeightsError) as caught:
        load_model(str(path), "cpu", "--init_from")
    assert str(caught.value).startswith(str(path)) and message in str(caught.value)
    assert str(caught.value).endswith("save_pretrained.") or str(caught.value).endswith("download it again.")


def test_a_cut_off_weights_file_or_another_model_is_one_sentence(hf_folder):
    path, _ = hf_folder
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(hf.WeightsError, match=r"is not a loadable GPT-2 \(SafetensorError: .*; write it again"):
        load_model(str(path), "cpu", "--init_from")
    edit_config(path, model_type="llama")
    with pytest.raises(hf.WeightsError, match="holds a llama model, not a GPT-2; give a GPT-2 folder"):
        load_model(str(path), "cpu", "--init_from")


@pytest.mark.parametrize("config_json", ['{"model_type": "gp', "", "\x00\xff binary", "[1, 2]", '"gpt2"'])
def test_a_damaged_config_json_is_not_a_hf_folder_and_never_raises(hf_folder, config_json):
    path, _ = hf_folder
    (path / "config.json").write_bytes(config_json.encode("latin-1"))
    assert not hf.is_hf_folder(str(path))
    (path / "config.json").unlink()
    assert not hf.is_hf_folder(str(path)) and not hf.is_hf_folder(str(path / "no such folder"))


def test_hf_ness_needs_a_model_type_beside_weights(hf_folder):
    path, _ = hf_folder
    assert hf.is_hf_folder(str(path))
    (path / "model.safetensors").unlink()  # a config.json alone, as a run folder's, is not a HF folder
    assert not hf.is_hf_folder(str(path))


def test_a_run_folder_whose_config_json_is_cut_off_still_loads(data_root, tmp_path):
    run = tmp_path / "run"
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={run}", "--train.max_steps=1",
                      "--optim.warmup_steps=1"])
    before = load_model(str(run), "cpu", "--init_from")
    assert not hf.is_hf_folder(str(run))  # its config.json holds the run's settings, and no model_type
    config = (run / "config.json").read_text()
    (run / "config.json").write_text(config[: len(config) // 2])  # cut off (a full disk, a killed copy)
    after = load_model(str(run), "cpu", "--init_from")  # from the checkpoint, which holds its own copy of the settings
    assert all(torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values()))


class SoftCapped(GPT):
    """A fork GPT-2 cannot compute: Gemma 2's logit soft-cap, 30 * tanh(logits / 30), and no new weight."""

    def logits(self, h):
        return 30 * torch.tanh(super().logits(h) / 30)


def tiny(cls=GPT, **fields):
    torch.manual_seed(0)
    net = cls(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, **fields))
    with torch.no_grad():
        net.lm_head.weight.mul_(100)  # logits of tens, where the cap bites
    return net


def test_export_is_checked_by_its_logits_and_a_fork_gpt2_cannot_compute_leaves_nothing(tmp_path):
    with pytest.raises(UserError) as refused:
        hf.export_hf(tiny(SoftCapped), str(tmp_path / "export"))
    message = str(refused.value)
    assert "differ by up to" in message and message.count(". ") == 0 and message.endswith(".")
    assert sorted(tmp_path.iterdir()) == []  # neither the folder nor its temporary sibling
    net = tiny(bias=False)  # no biases: GPT-2 with zero biases computes the same, and the check says so
    hf.export_hf(net, str(tmp_path / "export"))
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    x = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        assert torch.allclose(net(x)[..., :50257], theirs(x).logits, atol=1e-3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


class SlidingWindow(GPT):
    """Attends to the last 64 positions only: the same logits as GPT-2 over a row's first 64 tokens."""

    def hidden_states(self, idx, kv_cache=None, pos=None, attn_mask=None):
        if attn_mask is None and kv_cache is None:
            i = torch.arange(idx.size(1))
            attn_mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 64)
        return super().hidden_states(idx, kv_cache, pos, attn_mask)


class DocumentMasked(GPT):
    """A token attends only within its document: the same logits as GPT-2 on a row without <|endoftext|>."""

    def hidden_states(self, idx, kv_cache=None, pos=None, attn_mask=None):
        if attn_mask is None and kv_cache is None:
            ends = (idx == 50256).long()
            doc = torch.cumsum(ends, 1) - ends  # an <|endoftext|> belongs to the document it ends
            causal = torch.ones(idx.size(1), idx.size(1), dtype=torch.bool).tril()
            attn_mask = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
        return super().hidden_states(idx, kv_cache, pos, attn_mask)


@pytest.mark.parametrize("fork", [SlidingWindow, DocumentMasked])
def test_export_checks_every_position_and_document_boundaries(fork, tmp_path):
    """Forks that compute as GPT-2 does on a short row of ordinary tokens, and otherwise past position 64 or across
    <|endoftext|>: the check's rows are as long as the model reads, and one holds <|endoftext|> (it used two rows of
    64 random tokens, and both exported with exit 0)."""
    torch.manual_seed(0)
    net = fork(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=128))
    with pytest.raises(UserError, match="differ by up to"):
        hf.export_hf(net, str(tmp_path / "export"))
    assert sorted(tmp_path.iterdir()) == []


def test_a_weight_of_another_shape_is_one_sentence_naming_it_and_both_shapes(tmp_path):
    net = tiny()
    net.transformer.h[0].attn.c_attn = torch.nn.Linear(32, 64)  # grouped-query attention: fewer keys and values
    # both in this model's orientation, (out, in), as its own weights print: not GPT-2's Conv1D (in, out)
    with pytest.raises(UserError, match=r"transformer\.h\.0\.attn\.c_attn\.weight is \(64, 32\) where a Hugging Face "
                                        r"GPT-2's is \(96, 32\)"):
        hf.export_hf(net, str(tmp_path / "export"))
    assert sorted(tmp_path.iterdir()) == []


class NoLmHead(GPT):
    """Logits through the token embedding itself: GPT-2 exactly, without the name lm_head."""

    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        del self.lm_head

    def logits(self, h):
        return torch.nn.functional.linear(h, self.transformer.wte.weight)


class NoPositionTable(GPT):
    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        del self.transformer.wpe


class WithGain(GPT):
    def __init__(self, config, loss_path="chunked"):
        super().__init__(config, loss_path)
        self.transformer.h[0].gain = torch.nn.Parameter(torch.ones(config.n_embd))


def gpt2_shaped(cls):
    return cls(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=50257))


def test_gpt2_weights_go_into_a_fork_that_has_their_place_or_it_is_one_sentence(hf_folder):
    """Fine-tuning GPT-2 (checkpoint.load_path) into a fork, or sampling it (--init_from) after an edit of model.py:
    a dropped position table was silently left out (exit 0, another model), a gain was a KeyError traceback, and a
    model tied through its embedding without an lm_head was refused."""
    path, reference = hf_folder
    tied = gpt2_shaped(NoLmHead)
    hf.load_gpt2_weights(tied, str(path))
    x = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert torch.allclose(tied(x), reference(x).logits, atol=1e-5)
    for cls, name in ((NoPositionTable, "transformer.wpe.weight"), (WithGain, "transformer.h.0.gain")):
        with pytest.raises(UserError, match=f"^GPT-2's weights and this model's differ at {name} \\(one side has"):
            hf.load_gpt2_weights(gpt2_shaped(cls), str(path))
    wider = gpt2_shaped(GPT)
    wider.transformer.h[1].mlp.c_fc = torch.nn.Linear(32, 64)  # a SwiGLU-like width
    with pytest.raises(UserError, match=r"^GPT-2's transformer.h.1.mlp.c_fc.weight is \(128, 32\) and this model's "
                                        r"is \(64, 32\), so .* cannot be loaded into it;"):
        hf.load_gpt2_weights(wider, str(path))


def test_a_model_field_gpt2_does_not_have_keeps_its_value_when_the_shape_comes_from_gpt2(monkeypatch):
    """A new identity field edited into GPTConfig (n_kv_head) was a KeyError in use_source_shape: GPT-2's
    config.json has only GPT-2's six fields. The field keeps its value (its default is the model as it was)."""
    import dataclasses

    @dataclasses.dataclass
    class WithKvHeads(GPTConfig):
        n_kv_head: int = dataclasses.field(default=0, metadata={"role": "identity", "ladder": False})

    monkeypatch.setattr(hf, "SHAPE_FIELDS", [*hf.SHAPE_FIELDS, "n_kv_head"])
    config = WithKvHeads()
    hf.use_source_shape({"block_size": 64, "vocab_size": 50257, "n_layer": 2, "n_head": 2, "n_embd": 32,
                         "bias": True}, config, "gpt2", "GPT-2")
    assert (config.n_layer, config.n_embd, config.n_kv_head) == (2, 32, 0)


def test_gpt2_weights_with_an_output_layer_of_their_own_load_untied_or_are_refused(tmp_path):
    """A folder saved with tie_word_embeddings=false loaded into the tied GPT with exit 0, its lm_head written over
    the token embedding (logits 0.6 off). An untied model takes it; the tied one refuses in one sentence."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, tie_word_embeddings=False)
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    untied = gpt2_shaped(GPT)
    untied.lm_head = torch.nn.Linear(32, 50257, bias=False)
    hf.load_gpt2_weights(untied, str(tmp_path / "hf"))
    x = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert torch.allclose(untied(x)[..., :50257], reference(x).logits, atol=1e-5)
    with pytest.raises(UserError, match=r"has an output layer of its own \(tie_word_embeddings=false\), and this "
                                        r"model's logits multiply by its token embedding; untie them"):
        hf.load_gpt2_weights(gpt2_shaped(GPT), str(tmp_path / "hf"))


def test_a_tied_folder_with_a_nan_loads_and_an_untied_one_without_its_output_layer_is_refused(tmp_path):
    """A NaN is not equal to itself, so a tied folder (lm_head is wte) with one was called untied; an untied folder
    whose weights file lacks lm_head.weight loaded into an untied model with a random output layer, exit 0."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    tied = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32))
    with torch.no_grad():
        tied.transformer.wte.weight[5, 0] = float("nan")
    tied.save_pretrained(tmp_path / "nan")
    hf.load_gpt2_weights(gpt2_shaped(GPT), str(tmp_path / "nan"))
    untied = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, tie_word_embeddings=False)
    transformers.GPT2LMHeadModel(untied).save_pretrained(tmp_path / "cut")
    weights = load_file(tmp_path / "cut" / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "cut" / "model.safetensors", metadata={"format": "pt"})
    model = gpt2_shaped(GPT)
    model.lm_head = torch.nn.Linear(32, 50257, bias=False)
    with pytest.raises(UserError, match="does not match the weights at lm_head.weight"):
        hf.load_gpt2_weights(model, str(tmp_path / "cut"))

