"""Exercise 21: sampling with a KV cache, one token's forward pass per new token.

Goal: a GPT writes text one token at a time: run the model, turn the last position's logits into
probabilities (divided by a temperature, perhaps kept to the k most likely tokens), draw the next token, and
go on from the longer text. Run naively, every new token reruns the whole text: the work grows with the
square of its length. But the keys and values of the tokens already read never change, so a cache can keep
them: each layer's attention appends the new token's key and value and attends over all of them, and the
model reads only the new token, at the position the cache has reached. Write the cache and the loop. When the
text fills the model's block_size, start again from a fresh cache over the last block_size - 1 tokens.
In the project: sample.py, `KVCache` and `generate` (which the trainer's samples and sample.py's command use);
model.py's `CausalSelfAttention.forward` calls `kv_cache.append(k, v)`, and `GPT.hidden_states` starts the
positions at `kv_cache.length`.
Check: python exercises/check.py 21
(your cache against sample.py's, then your generate against sample.py's generate on a small GPT: the same tokens
from the same random generator, greedy, with temperature and top-k, and past block_size; and no more positions
through the model than the cache needs)
"""

import torch
import torch.nn.functional as F

from sample import filter_logits


class KVCache:
    def __init__(self, n_layer):
        """An empty cache for a model of `n_layer` blocks."""
        self.layers = [None] * n_layer
        self.layer = 0

    def append(self, k, v):
        """Called by the attention of each block in turn, with the new keys and values (B, heads, T, head size):
        store them after those of this block's earlier calls and return all of them, (keys, values)."""
        past = self.layers[self.layer]
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        self.layers[self.layer] = (k, v)
        self.layer = (self.layer + 1) % len(self.layers)
        return k, v

    @property
    def length(self):
        """How many positions the cache holds (the position of the next token)."""
        return 0 if self.layers[0] is None else self.layers[0][0].size(2)


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
    """`idx` (B, T) followed by `max_new_tokens` tokens drawn one at a time from `model` (a model.GPT, called as
    model(tokens, kv_cache=cache) for the logits), as sample.py's generate: the last position's logits, kept to the
    top_k most likely by sample.filter_logits, divided by `temperature` (0: the most likely token, no draw), then
    one draw with torch.multinomial from `generator`. Returns (B, T + max_new_tokens)."""
    cache, new = KVCache(model.config.n_layer), idx
    for _ in range(max_new_tokens):
        if cache.length + new.size(1) > model.config.block_size:
            cache, new = KVCache(model.config.n_layer), idx[:, -(model.config.block_size - 1):]
        logits = filter_logits(model(new, kv_cache=cache)[:, -1, :], top_k=top_k)
        if temperature == 0:
            new = logits.argmax(dim=-1, keepdim=True)
        else:
            new = torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat([idx, new], dim=1)
    return idx
