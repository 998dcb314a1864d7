"""Exercise 10: GPT-2's parts, each equal to model.py's in value and in gradient.

Goal: write the parts that make GPT-2 GPT-2: the MLP, the pre-LayerNorm residual block, the token +
position embeddings, the output layer tied to the token embedding, GPT-2's initialisation, and the
cross-entropy of the next token. Each must give model.py's values and, for backward, model.py's
gradients: a part with the right output and a wrong gradient trains another model. Exercise 16 assembles
these parts with your attention into a whole GPT, which the real trainer trains.
In the project: model.py (`MLP`, `Block`, `GPT.__init__`, `GPT.hidden_states`, and `GPT.forward`'s full
path: `F.cross_entropy`).
Check: python exercises/check.py 10
(each function against model.py on random shapes: the values, then the gradients of every input and weight)
"""

import torch
import torch.nn as nn


def mlp(module, x):
    """The MLP of a block: widen each position's vector 4x, a non-linearity, and back. `module` has
    `c_fc` (n_embd -> 4 n_embd), `gelu` and `c_proj` (4 n_embd -> n_embd); x is (B, T, n_embd)."""
    return module.c_proj(module.gelu(module.c_fc(x)))


def block_forward(block, x, kv_cache=None, attn_mask=None):
    """One transformer block, pre-LayerNorm: each of attention and the MLP reads a normalised copy of the
    residual stream and adds its output back to it. `block` has ln_1, attn, ln_2, mlp; attention takes the
    KV cache and the mask as its second and third arguments (model.py's `CausalSelfAttention.forward`)."""
    x = x + block.attn(block.ln_1(x), kv_cache, attn_mask)
    return x + block.mlp(block.ln_2(x))


def embed(gpt, idx, start=0):
    """The input of the first block: each token's embedding plus its position's. `gpt.transformer` has
    `wte` (vocabulary x n_embd) and `wpe` (block_size x n_embd); idx is (B, T) token ids, the tokens at
    positions start to start + T - 1 (start is above 0 when a KV cache holds the tokens before them)."""
    positions = torch.arange(start, start + idx.size(1), device=idx.device)
    return gpt.transformer.wte(idx) + gpt.transformer.wpe(positions)


def tie_weights(gpt):
    """Make the output layer `gpt.lm_head` and the token embedding `gpt.transformer.wte` one and the same
    weight (Press & Wolf 2017, as GPT-2): a token's input vector is the one its logit is scored with."""
    gpt.transformer.wte.weight = gpt.lm_head.weight


def init_weights(module, n_layer):
    """GPT-2's initialisation of one module (the GPT applies it to every module, in order): what the
    weights of a Linear or an Embedding start as, and its bias. A Linear marked `residual_projection`
    adds into the residual stream, which n_layer blocks add to twice each."""
    if isinstance(module, nn.Linear):
        std = 0.02 * (2 * n_layer) ** -0.5 if getattr(module, "residual_projection", False) else 0.02
        torch.nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            torch.nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)


def next_token_loss(logits, targets):
    """The mean cross-entropy of the next token, written out (no F.cross_entropy): logits (B, T, vocabulary)
    scored against targets (B, T), where targets are the inputs shifted by one token (the loader already
    shifted them: targets[:, t] is the token after idx[:, t]); a target of -1 is not scored."""
    log_probs = logits.float().log_softmax(dim=-1)
    scored = targets != -1
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * scored).sum() / scored.sum()
