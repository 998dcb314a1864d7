"""The check of exercise 21: sampling with a KV cache. The truth is sample.py: its KVCache on the
same keys and values, and its generate on the same small GPT with a generator seeded alike, so the
same draws give the same tokens. The model's own blocks count the positions each generate runs
through the model (the cache's saving), so that a call made only to feed a counter, beside a full
recompute for the tokens, counts both. Those counts live in the answer's process, which could
rewrite them; what decides is measured outside it: over a whole block of 1024 positions, the sandbox
counts the CPU the answer's processes use, and a generate that reruns the text costs hundreds of
times sample.py's."""

import random
import time

import torch

from exercises.grader.checking import ExerciseFailed, compared, shown
from exercises.grader.feed_sampling import (CASES, LONG, cache_steps, long_answers, long_generation,
                                            run_generate, sampling_answers)
from exercises.grader.grading import OverCpu

# The CPU the long case may take: this many times sample.py's, measured here, and at least CPU_FLOOR
# seconds (the answer's process also loads the answer file). Rerunning the text costs hundreds of
# times more.
CPU_TIMES, CPU_FLOOR = 5, 3.0


def compare_cache(mine, want):
    for i, (got, expected) in enumerate(zip(mine, want)):
        layer, round_ = i % 2, i // 2 + 1
        keys = got["returned"][0] if isinstance(got["returned"], (list, tuple)) else None
        if not torch.is_tensor(keys) or keys.shape != expected["returned"][0].shape:
            raise ExerciseFailed(f"after {round_} appends to layer {layer}, your append returns "
                                 f"keys of shape {tuple(getattr(keys, 'shape', ()))} where "
                                 "sample.py's KVCache returns "
                                 f"{tuple(expected['returned'][0].shape)}: the layer's earlier "
                                 "keys, then the new ones, along the positions (dim 2); the "
                                 "model calls append once per layer, in order.")
        values = got["returned"][1] if len(got["returned"]) > 1 else None
        if not (torch.equal(keys, expected["returned"][0]) and torch.is_tensor(values)
                and torch.equal(values, expected["returned"][1])):
            raise ExerciseFailed(f"after {round_} appends to layer {layer}, your append returns "
                                 "other keys or values than sample.py's KVCache: each layer "
                                 "keeps its own, and (keys, values) come back in that order.")
        if got["length"] != expected["length"]:
            raise ExerciseFailed(f"after {round_} appends to each layer your cache's length is "
                                 f"{got['length']!r}, "
                                 f"{compared(got['length'], expected['length'])} what sample.py's "
                                 "says: the positions it holds, the next token's position.")


def check_kv_cache(answers):
    import sample

    seed = random.randrange(2**31)
    keys = [torch.randn(1, 2, t, 4) for t in (3, 3, 1, 1, 2, 2)]
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 512, (rows, length), generator=generator)
               for rows, length, *_ in CASES]
    mine = answers.run(sampling_answers, {"seed": seed, "keys": keys, "prompts": prompts})
    compare_cache(mine["cache"], cache_steps(sample.KVCache, keys))
    wants = [run_generate(sample.generate, seed, case, prompt)
             for case, prompt in zip(CASES, prompts)]
    # The positions first, then the cost of a long text, then the tokens: positions and cost do not
    # hang on the tokens drawn, while a generate that reruns the whole text gets logits a float
    # rounding away from the cache's, which could turn a near tie into another token.
    for case, got, want in zip(CASES, mine["generated"], wants):
        tokens, what = got["tokens"], described(case)
        if not torch.is_tensor(tokens) or tokens.shape != want["tokens"].shape:
            raise ExerciseFailed(f"your generate returned {shown(tokens)[:50]} of shape "
                                 f"{tuple(getattr(tokens, 'shape', ()))} for {what}, where "
                                 f"sample.py's returns {tuple(want['tokens'].shape)}: the prompt "
                                 "followed by the new tokens.")
        if got["positions"] != want["positions"]:
            more = "more" if got["positions"] > want["positions"] else "fewer"
            raise ExerciseFailed(f"your generate ran {got['positions']} positions through the "
                                 f"model for {what}, {more} than sample.py's: with the cache, "
                                 "feed the prompt once, then only each new token (and the last "
                                 "block_size - 1 tokens when the cache is full).")
    long_tokens, long_want = run_long_case(answers, seed)
    for case, got, want in zip(CASES, mine["generated"], wants):
        rows, length, new, temperature, top_k = case
        tokens = got["tokens"]
        if not torch.equal(tokens, want["tokens"]):
            at = (tokens != want["tokens"]).any(0).nonzero()[0].item() - length
            advice = ("the most likely token of the last position's logits, with the new token "
                      "at the position the cache has reached" if temperature == 0 else
                      "filter the last position's logits (sample.filter_logits, top_k), divide "
                      "them by the temperature, softmax, and draw one token with "
                      "torch.multinomial(probs, 1, generator=generator)")
            raise ExerciseFailed(f"your generate's new token {at + 1} differs from sample.py's "
                                 f"for {described(case)}: {advice}.")
    if not (torch.is_tensor(long_tokens) and long_tokens.shape == long_want.shape
            and torch.equal(long_tokens, long_want)):
        raise ExerciseFailed(f"over {LONG['block_size'] - 1} new tokens after a prompt of 1 "
                             f"(block_size {LONG['block_size']}) your generate's tokens differ "
                             "from sample.py's, though they matched on short texts: keep "
                             "appending to one cache until the text fills block_size.")
    naive = sum(rows * min(16, length + i)
                for rows, length, new, _, _ in CASES[1:2] for i in range(new))
    return (f"your cache and generate give sample.py's tokens in all {len(CASES)} cases, greedy, "
            f"sampled and past block_size, reading each token once: {CASES[1][2]} new tokens "
            f"after a prompt of {CASES[1][1]} cost "
            f"{CASES[1][0] * (CASES[1][1] + CASES[1][2] - 1)} positions through the model, where "
            f"rerunning the whole text would cost {naive}.")


def described(case):
    rows, length, new, temperature, top_k = case
    return (f"{new} new tokens after a prompt of {length}"
            + (" (past block_size 16)" if length + new > 16 else "")
            + (", greedy" if temperature == 0 else f", temperature {temperature}, top_k {top_k}"))


def run_long_case(answers, seed):
    """(the answer's tokens, sample.py's) over a whole block, the answer's generate allowed a
    cost of the same order as sample.py's: measured by the sandbox (all the answer's processes
    together) against sample.py's, measured here."""
    import sample

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the answer's process runs (a second thread spins, costing CPU)
    try:
        start = time.thread_time()
        want = long_generation(sample.generate, seed)
        cost = time.thread_time() - start
    finally:
        torch.set_num_threads(threads)
    new = LONG["block_size"] - 1
    limit = max(CPU_FLOOR, CPU_TIMES * cost)
    try:
        return answers.run(long_answers, seed, cpu=limit), want
    except OverCpu:
        raise ExerciseFailed(
            f"your generate used more than {limit:.2g} s of CPU for {new} new tokens after a "
            f"prompt of 1 (block_size {LONG['block_size']}), where sample.py's used {cost:.2g} s: "
            "with the cache each new token is one position through the model, while rerunning "
            "the text costs the square of its length.") from None
