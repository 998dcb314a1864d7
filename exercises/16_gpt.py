"""Exercise 16, the capstone: all of GPT-2, attention included, assembled by you and trained by the real trainer.

Goal: write causal self-attention out (the scores of every query against every key, scaled, masked so that no
token sees a later one, softmaxed, and used to mix the values), then assemble GPT-2 from it and from your
parts of exercise 10: the attention, MLP, block and GPT modules, with model.py's names (a checkpoint is read
by name) created in model.py's order (so the same seed gives the same weights), and the GPT's forward. Then
`python train.py --train.model_module=exercises/16_gpt.py` trains a GPT in which you wrote every part; it
samples with the trainer's KV cache, which your attention serves too.
In the project: model.py (`CausalSelfAttention`, whose forward calls F.scaled_dot_product_attention; `MLP`,
`Block`, `GPT.__init__`, `GPT.hidden_states`, `GPT.forward`), sample.py's `KVCache`.
Check: python exercises/check.py 16
(your attention against F.scaled_dot_product_attention, values and gradients, with and without a cache; your
GPT against model.py's on the same seed: its weights, logits, loss and every gradient, on packed rows (`pos`
and `attn_mask`, as hellaswag_eval.py sends them) and in training mode with dropout 0.1 (the same seed draws
the same masks when the dropouts come in model.py's order); then train.py trains your GPT and model.py's at the
quick start's shape, and the two whole loss curves must match)
"""

import math

import torch
import torch.nn as nn

import model
from exercises import answers_of

parts = answers_of(10, __file__)  # your mlp, block_forward, embed, tie_weights, init_weights, next_token_loss


def attention(q, k, v, allowed=None, dropout=0.0):
    """Scaled dot-product attention, written out: queries q (B, heads, Tq, head size) against keys and values k, v
    (B, heads, Tk, head size), Tq <= Tk. `allowed` (booleans that broadcast to (B, heads, Tq, Tk)) says which keys
    each query may see; without it, attention is causal: the queries are the last Tq of the Tk positions (the
    first Tk - Tq are cached), and each sees its own position and those before it. `dropout` is the probability
    of zeroing each attention weight (torch.nn.functional.dropout, applied to the softmaxed weights before they
    mix the values, as F.scaled_dot_product_attention's dropout_p does). Returns (B, heads, Tq, head size)."""
    Tq, Tk = q.size(-2), k.size(-2)
    if allowed is None:
        allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.nn.functional.dropout(weights, dropout) @ v if dropout else weights @ v


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        """model.py's attention modules, named and ordered as there (c_attn, c_proj marked residual_projection,
        resid_dropout), the number of heads as `n_head` and the attention's dropout as `dropout`."""
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv_cache=None, attn_mask=None):
        """x (B, T, C) -> (B, T, C): queries, keys and values of every head, the keys and values appended to
        `kv_cache` when there is one (its `append(k, v)` returns all the keys and values so far), your attention
        (with `attn_mask` as `allowed` when given; dropping out its weights while training, as model.py does
        without a mask or a cache), the heads side by side again, then c_proj."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
        dropout = self.dropout if self.training and attn_mask is None and kv_cache is None else 0.0
        y = attention(q, k, v, attn_mask, dropout).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        """model.py's MLP modules, named and ordered as there (c_fc, gelu, c_proj marked residual_projection,
        dropout)."""
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        """Your mlp, then dropout."""
        return self.dropout(parts.mlp(self, x))


class Block(nn.Module):
    def __init__(self, config):
        """model.py's block modules, named and ordered as there (ln_1, attn, ln_2, mlp)."""
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, attn_mask=None):
        """Your block_forward."""
        return parts.block_forward(self, x, kv_cache, attn_mask)


class GPT(nn.Module):
    def __init__(self, config, loss_path="chunked"):
        """model.py's GPT modules, named and ordered as there (transformer: wte, wpe, drop, h, ln_f; then lm_head),
        tied by your tie_weights and initialised by your init_weights, module by module in order. `loss_path` is
        the trainer's: your loss has one path, whatever it says."""
        super().__init__()
        self.config, self.loss_path = config, loss_path
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout), h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        parts.tie_weights(self)
        self.apply(lambda module: parts.init_weights(module, config.n_layer))

    def hidden_states(self, idx, kv_cache=None, pos=None, attn_mask=None):
        """The final LayerNorm of the last block's output for every position of idx (B, T): your embed from the
        position the cache has reached (`kv_cache.length`; 0 without a cache), or at the positions `pos` when the
        caller packs several sequences in a row, then dropout and every block."""
        if pos is None:
            x = parts.embed(self, idx, 0 if kv_cache is None else kv_cache.length)
        else:
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x, kv_cache, attn_mask)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, kv_cache=None):
        """The logits (B, T, vocabulary) without `targets`; with them, your next-token loss (model.py's rule)."""
        logits = self.lm_head(self.hidden_states(idx, kv_cache))
        return logits if targets is None else parts.next_token_loss(logits, targets)

    # What the trainer asks every model (model_module.WHAT_THE_TRAINER_ASKS): model.py's answers, which read the model
    # by its module types, so they fit this GPT as they fit model.py's.
    blocks = model.GPT.blocks
    param_groups, num_params, flops_per_token = model.GPT.param_groups, model.GPT.num_params, model.GPT.flops_per_token
    logits, score_tokens, param_kinds = model.GPT.logits, model.GPT.score_tokens, model.GPT.param_kinds
    num_params_with_output = model.GPT.num_params_with_output
