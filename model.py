"""The GPT-2 model: configuration, architecture, parameter and FLOP counts, optimizer groups.

This is the GPT-2 of Radford et al. (2019) as reproduced by nanoGPT: pre-LayerNorm transformer
blocks, learned position embeddings, a GELU(tanh) MLP and a language-model head that shares its
weights with the token embedding. `train.py` builds a `GPT` from a `GPTConfig`, asks it for an
optimizer, and calls `forward` for the loss; sampling (sample.py, with its KV cache) and evaluation
call `forward` for the logits.
"""

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

@dataclass(slots=True)
class GPTConfig:
    block_size: int = 1024  # longest sequence the model reads (GPT-2: 1024)
    # GPT-2's 50,257 tokens (tokenizer.GPT2_VOCAB_SIZE) padded to a multiple of 64, because matrix
    # multiplies on GPUs run faster on such shapes; the extra rows never win a sample.
    vocab_size: int = 50304  # output vocabulary: GPT-2's 50,257 tokens padded to a multiple of 64 for speed
    n_layer: int = 12  # number of transformer blocks
    n_head: int = 12  # attention heads per block; must divide n_embd
    n_embd: int = 768  # width of the residual stream
    dropout: float = 0.0  # dropout probability; 0 for pretraining, try 0.1 when fine-tuning
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2


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

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            # Generation feeds one new token at a time: attend to the cached past plus the new keys.
            k, v = kv_cache.append(k, v)
        # With a cache and a single new token there is nothing in the future to mask.
        causal = kv_cache is None or T > 1
        if kv_cache is not None and T > 1 and k.size(2) != T:
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

    def forward(self, x, kv_cache=None):
        # Pre-LayerNorm: normalise the input of each sub-layer, keep the residual stream untouched.
        x = x + self.attn(self.ln_1(x), kv_cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
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
        """Logits for every position, and the mean cross-entropy where `targets` is not -1."""
        B, T = idx.size()
        start = 0 if kv_cache is None else kv_cache.length
        assert start + T <= self.config.block_size, f"sequence of {start + T} > block_size"
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, kv_cache)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1
            )
        return logits, loss

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

    def configure_optimizers(self, optim, device_type):
        """AdamW over this model from the `optim` config section (lr, betas, eps, weight decay)."""
        # Decay the matrices (weights of matmuls and embeddings), not biases or LayerNorm gains:
        # shrinking those towards zero only hurts (as in GPT-3 and nanoGPT).
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # The fused kernel updates all tensors in one launch on CUDA; it does not exist on CPU.
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        extra = {"fused": True} if fused else {}
        return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **extra)
