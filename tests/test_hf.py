import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf  # noqa: E402
from checkpoint import load_model  # noqa: E402
from conftest import ROOT, TINY, run_train  # noqa: E402
from tokenizer import get_tokenizer  # noqa: E402


@pytest.fixture
def hf_folder(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model


def test_imported_hf_weights_give_the_same_logits(hf_folder):
    path, reference = hf_folder
    ours = load_model(str(path), "cpu")  # --init_from=<local HF folder>
    assert ours.config.vocab_size == 50257 and ours.config.block_size == 64
    x = torch.randint(0, 50257, (2, 40))
    with torch.no_grad():
        assert torch.allclose(ours(x)[0], reference(x).logits, atol=1e-5)


def test_export_round_trips_through_gpt2lmheadmodel(data_root, tmp_path):
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=2"])
    subprocess.run([sys.executable, "checkpoint.py", "export-hf", str(tmp_path / "run"), str(tmp_path / "export")],
                   cwd=ROOT, check=True, capture_output=True)
    ours = load_model(str(tmp_path / "run"), "cpu")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    assert theirs.config.vocab_size == 50257  # the padded rows are dropped
    x = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert torch.allclose(ours(x)[0][..., :50257], theirs(x).logits, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    text = "ROMEO:\nBut soft, what light through yonder window breaks?"
    assert tokenizer(text)["input_ids"] == get_tokenizer().encode(text)
    again = load_model(str(tmp_path / "export"), "cpu")  # and back in through --init_from
    with torch.no_grad():
        assert torch.allclose(again(x)[0], theirs(x).logits, atol=1e-5)


def test_export_refuses_a_folder_that_is_not_empty(data_root, tmp_path):
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=1"])
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "keep.txt").write_text("mine")
    result = subprocess.run([sys.executable, "checkpoint.py", "export-hf", str(tmp_path / "run"),
                             str(tmp_path / "export")], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode != 0 and "is not empty" in result.stderr
    assert (tmp_path / "export" / "keep.txt").read_text() == "mine"


def test_without_transformers_hf_sources_fail_with_one_sentence(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what an uninstalled package looks like
    with pytest.raises(hf.WeightsError, match="needs the transformers package; install it with"):
        load_model("gpt2", "cpu")
