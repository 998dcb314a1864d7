"""Exercise 19: learning the merges, how GPT-2's vocab.bpe was made.

Goal: a byte-level BPE tokenizer learns its merges from a corpus (Sennrich et al. 2016; GPT-2 learned 50,000):
count every adjacent pair of pieces in every pre-token, each as often as the pre-token occurs; merge the most
frequent pair everywhere it occurs; repeat on the merged pieces. The order in which merges are learned is
their rank, which exercise 11's loop applies. When several pairs are equally frequent, take the one whose left
piece was made first (the 256 byte characters count as made first, in the order of their code points; each
merge makes a new piece, in the order learned), then whose right piece was.
In the project: the merges data.py's tokenizer applies come from GPT-2's vocab.bpe; the Hugging Face
`tokenizers` library learns such merges (`BpeTrainer`, with GPT-2's byte-level pre-tokenizer).
Check: python exercises/check.py 19
(120 merges learned from a random page of Shakespeare, against the tokenizers library's on the same text;
needs `pip install tokenizers`)
"""

import collections


def learn_merges(words, num_merges):
    """The first `num_merges` merges learned from `words`, {pre-token: how often it occurs}, each pre-token
    written in GPT-2's byte characters (one character per byte, as exercise 18's map). Returns a list of
    (left, right) pairs of pieces, in the order learned."""
    pieces = {word: list(word) for word in words}
    made = {character: n for n, character in enumerate(sorted({c for word in words for c in word}))}
    merges = []
    for _ in range(num_merges):
        counts = collections.Counter()
        for word, count in words.items():
            for pair in zip(pieces[word], pieces[word][1:]):
                counts[pair] += count
        if not counts:
            break
        best = max(counts, key=lambda pair: (counts[pair], -made[pair[0]], -made[pair[1]]))
        merges.append(best)
        made.setdefault(best[0] + best[1], len(made) + 256)  # after every byte character, in the text or not
        for word, parts in pieces.items():
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            pieces[word] = merged
    return merges
