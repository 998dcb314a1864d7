"""Exercise 3: the causal attention mask.

Goal: write the attention of one GPT block with an explicit causal mask, the T x T matrix that
F.scaled_dot_product_attention(..., is_causal=True) never builds. A token may attend to itself and
to the tokens before it, never to the ones after: otherwise the model could read the very token it
is asked to predict.
In the project: model.py, `CausalSelfAttention.forward` (the last branch, with is_causal).
Check: python exercises/check.py 3
(your output against the project's module on random inputs and sizes; it also tests that no output
depends on a later token)
"""

import math

import torch


def causal_self_attention(attn, x):
    """What `attn(x)` computes, for `attn` a model.CausalSelfAttention and `x` of shape (B, T, C)
    (no KV cache, no dropout), with the causal mask written out.
    """
    B, T, C = x.size()
    head_size = C // attn.n_head
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, attn.n_head, head_size).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_size)
    allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    y = (weights @ v).transpose(1, 2).contiguous().view(B, T, C)
    return attn.c_proj(y)
