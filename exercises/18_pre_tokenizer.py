"""Exercise 18: GPT-2's pre-tokenizer and its byte map, what happens before the merges.

Goal: before any merge, GPT-2 cuts text into pre-tokens with one regular expression (a word takes the
space before it; numbers, runs of punctuation, contractions and runs of whitespace are pieces of their
own), so that no token ever spans two words; and it writes every byte of a pre-token as one printable
character, so that the merges and encoder.json are plain text: a byte that is printable stands for
itself, and each other byte (controls, the space, a few more) gets a character of its own above 255.
Write both. With exercise 11's merges they make tiktoken's GPT-2 ids.
In the project: data.py's `get_tokenizer` (tiktoken's GPT-2 encoding, whose pattern is tiktoken_ext's
`r50k_pat_str`); the byte map is `bytes_to_unicode` in GPT-2's encoder.py (Radford et al. 2019).
Check: python exercises/check.py 18
(your map against tiktoken's bytes and encoder.json for all 256 bytes; your pre-tokens of a Shakespeare page and
of some awkward text against tiktoken's, and encoded one by one they must give tiktoken's ids of the whole)
"""

import regex


def byte_characters():
    """{byte (0 to 255): the one-character string GPT-2 writes it as}."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


def pre_tokenize(text):
    """The pre-tokens of `text`, in order: strings that joined together give the text back. (The `regex` module,
    unlike `re`, knows the classes \\p{L}, letters, and \\p{N}, numbers.)"""
    # GPT-2's pattern (encoder.py): contractions, words, numbers, punctuation, then the two kinds of whitespace.
    return regex.findall(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""", text)
