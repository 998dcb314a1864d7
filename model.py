"""GPT-2: its configuration, attention, MLP, block and the GPT itself, then parameter and FLOP counts.

This is the GPT-2 of Radford et al. (2019) as reproduced by nanoGPT: pre-LayerNorm transformer
blocks, learned position embeddings, a GELU(tanh) MLP and an output layer that shares its weights
with the token embedding. `model(idx)` gives the logits, `model(idx, targets)` the loss: train.py
calls the second, sampling and evaluation the first. The loss itself is in cross_entropy.py.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F

import cross_entropy

# Each field's role when a run resumes (config.py explains roles): the model's shape is what the run *is*.
SHAPE = {"role": "identity", "ladder": False}
SHAPE_BY_LADDER = {"role": "identity", "ladder": True}  # ladder.py derives these from the model size
APPLIED = {"role": "applied", "ladder": False}


@dataclass(slots=True)
class GPTConfig:
    block_size: int = field(default=1024, metadata=SHAPE)  # longest sequence the model reads (GPT-2: 1024)
    # output vocabulary: GPT-2's 50,257 tokens padded to a multiple of 64, as GPU matmuls run faster on such shapes
    vocab_size: int = field(default=50304, metadata=SHAPE)
    n_layer: int = field(default=12, metadata=SHAPE_BY_LADDER)  # number of transformer blocks
    n_head: int = field(default=12, metadata=SHAPE_BY_LADDER)  # attention heads per block; must divide n_embd
    n_embd: int = field(default=768, metadata=SHAPE_BY_LADDER)  # width of the residual stream
    dropout: float = field(default=0.0, metadata=APPLIED)  # dropout probability; 0 to pretrain, 0.1 to fine-tune
    bias: bool = field(default=True, metadata=SHAPE)  # biases in Linear and LayerNorm layers, as in GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.dropout = config.dropout
        # One matrix computes queries, keys and values for all heads at once.
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, kv_cache=None, attn_mask=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            # Generation feeds one new token at a time: attend to the cached past plus the new keys.
            k, v = kv_cache.append(k, v)
        # With a cache and a single new token there is nothing in the future to mask.
        causal = kv_cache is None or T > 1
        if attn_mask is not None:
            # Packed evaluation rows (hellaswag_eval.py): the caller says who may see whom.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        elif kv_cache is not None and T > 1 and k.size(2) != T:
            # Several new tokens after a cached prefix: each may see the whole prefix and its past.
            past = k.size(2) - T
            mask = torch.ones(T, k.size(2), dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            # PyTorch picks flash attention on GPUs for this call; it never builds the T x T matrix.
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
            )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # GPT-2 used the tanh approximation of GELU; keeping it makes imported weights exact.
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, attn_mask=None):
        # Pre-LayerNorm: normalise the input of each sub-layer, keep the residual stream untouched.
        x = x + self.attn(self.ln_1(x), kv_cache, attn_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, loss_path="chunked"):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017, used by GPT-2): the output layer reuses the embedding.
        self.transformer.wte.weight = self.lm_head.weight
        self.loss_path = loss_path  # how forward computes the loss: "chunked" or "full" (cross_entropy.py)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_projection", False):
                # GPT-2 paper, section 2.3: scale the layers that add into the residual stream by
                # 1/sqrt(N), N = number of such additions (two per block), so its variance stays ~1.
                std *= (2 * self.config.n_layer) ** -0.5
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, kv_cache=None):
        """The logits (B, T, vocabulary) without `targets`; the mean cross-entropy loss with them.
        Targets of -1 are not scored. With targets the loss goes through `self.loss_path` (cross_entropy.py):
        "chunked" never builds the full logits, "full" is nanoGPT's logits-then-F.cross_entropy."""
        x = self.hidden_states(idx, kv_cache)
        if targets is None:
            return self.lm_head(x)
        return cross_entropy.next_token_loss(x, self.lm_head.weight, targets, self.loss_path)

    def hidden_states(self, idx, kv_cache=None, pos=None, attn_mask=None):
        """The final layer-normed hidden state of every position, before the output layer. The
        evaluations apply the output layer only where a token is scored, and pack several sequences
        in a row: then `pos` gives each token's position and `attn_mask` (B, 1, T, past + T) which
        keys each token may attend to."""
        T = idx.size(1)
        start = 0 if kv_cache is None else kv_cache.length
        if pos is None:
            assert start + T <= self.config.block_size, f"sequence of {start + T} > block_size"
            pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, kv_cache, attn_mask)
        return self.transformer.ln_f(x)

    def num_params(self, non_embedding=False):
        """Parameter count. Non-embedding (Kaplan et al. 2020) leaves out token and position
        embeddings; it is the N in scaling laws, Chinchilla's 20 tokens per parameter and the ladder."""
        n = sum(p.numel() for p in self.parameters())  # the tied lm_head is counted once
        if non_embedding:
            n -= self.transformer.wte.weight.numel() + self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self):
        """Training FLOPs per token: 6N + 12·L·d·T (PaLM, appendix B).

        6N counts the forward (2N) and backward (4N) matrix multiplies, with N the non-embedding
        parameters plus the output layer (the embedding lookup is free, the lm_head matmul is not).
        12·L·d·T is attention's query-key and attention-value products, which have no parameters."""
        c = self.config
        n = self.num_params(non_embedding=True) + c.n_embd * c.vocab_size
        return 6 * n + 12 * c.n_layer * c.n_embd * c.block_size


def gpt_class(module="model"):
    """The GPT class that train.model_module names: this file's, or the one in a .py file of your own
    (the course's capstone trains a student's GPT this way; it takes the same GPTConfig)."""
    if module == "model":
        return GPT
    import importlib.util
    import os
    if not module.endswith(".py") or not os.path.isfile(module):
        raise ValueError(f"train.model_module={module!r} is neither model nor a .py file; give the path of the file "
                         f"that defines your GPT class.")
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(module))[0], module)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    if not hasattr(loaded, "GPT"):
        raise ValueError(f"{module} defines no class GPT; name your model class GPT.")
    return loaded.GPT
