"""What the answer's process runs for exercise 21 (checks_sampling.py grades it): the answer's KV cache,
its generate on a tiny GPT whose own blocks count the positions they compute, and its generate over a whole
block of 1024 positions, whose cost the sandbox measures. feeding.py says what a feed module is, and holds."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from exercises.grader.feeding import tiny_gpt


CASES = [  # (rows, prompt length, new tokens, temperature, top_k): greedy, sampled, top-k, past block_size (16)
    (2, 4, 8, 0.0, None), (2, 5, 10, 1.0, None), (1, 3, 10, 0.8, 20), (1, 10, 14, 1.0, None)]


def cache_steps(cache_class, keys):
    """What a cache answers when 2 layers append, in turn, the given keys (values: keys + 1), 3 rounds."""
    cache, answers = cache_class(2), []
    for k in keys:
        answers.append({"returned": cache.append(k, k + 1), "length": cache.length})
    return answers


def counting_gpt(seed):
    """tiny_gpt(seed) whose own forward counts the positions it computes, in every block: a hook on one module
    (the embedding, as this check once had) can be fed by a call made only for it, or removed."""
    from model import Block

    model = tiny_gpt(seed).eval()
    counted = []
    for block in model.transformer.h:
        block.__class__ = type("CountedBlock", (Block,), {
            "forward": lambda self, x, *args, **kwargs: (counted.append(x.shape[0] * x.shape[1]),
                                                         Block.forward(self, x, *args, **kwargs))[1]})
    return model, counted


class EmbeddedTokens(TorchDispatchMode):
    """Counts the tokens looked up in the token embedding (`aten.embedding` on a table of `vocab` rows), below any
    Python object an answer could reach: the blocks' count lives in a closure an answer that looked for it could
    overwrite (a review did, after a full recompute); this one sees the recompute's lookups all the same."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.tokens = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.embedding.default and args[0].shape[0] == self.vocab:
            self.tokens += args[1].numel()
        return func(*args, **(kwargs or {}))


def run_generate(generate, seed, case, prompt):
    rows, _, new, temperature, top_k = case
    model, counted = counting_gpt(seed)
    with EmbeddedTokens(model.config.vocab_size) as embedded:
        tokens = generate(model, prompt, new, temperature=temperature, top_k=top_k,
                          generator=torch.Generator().manual_seed(seed))
    return {"tokens": tokens, "positions": max(sum(counted) // len(model.transformer.h), embedded.tokens)}


def sampling_answers(answers, inputs):
    return {"cache": cache_steps(answers.KVCache, inputs["keys"]),
            "generated": [run_generate(answers.generate, inputs["seed"], case, prompt)
                          for case, prompt in zip(CASES, inputs["prompts"])]}


# The long case: a whole block, one token of prompt then 1023 drawn. With the cache that is 1023 positions through
# the model; rerunning the text for each token, half a million.
LONG = {"n_layer": 2, "n_head": 4, "n_embd": 256, "block_size": 1024, "vocab_size": 512}


def long_generation(generate, seed):
    """generate's tokens over the long case's whole block, on a GPT and a generator drawn from `seed`."""
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**LONG)).eval()
    prompt = torch.randint(0, LONG["vocab_size"], (1, 1), generator=torch.Generator().manual_seed(seed))
    return generate(model, prompt, LONG["block_size"] - 1, temperature=1.0,
                    generator=torch.Generator().manual_seed(seed + 1))


def long_answers(answers, seed):
    return long_generation(answers.generate, seed)
