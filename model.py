"""The GPT-2 model: configuration, architecture, the output layer + loss, parameter and FLOP counts.

This is the GPT-2 of Radford et al. (2019) as reproduced by nanoGPT: pre-LayerNorm transformer
blocks, learned position embeddings, a GELU(tanh) MLP and a language-model head that shares its
weights with the token embedding. `train.py` builds a `GPT` from a `GPTConfig` (optimizer.py builds
its optimizer) and calls `forward` for the loss; sampling (sample.py, with its KV cache) and
evaluation call `forward` for the logits.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F

# Each field's role on resume (config.py explains the roles): the shape is what the run *is*.
SHAPE = {"role": "identity", "ladder": False}
SHAPE_BY_LADDER = {"role": "identity", "ladder": True}  # ladder.py derives these from the model size


@dataclass(slots=True)
class GPTConfig:
    block_size: int = field(default=1024, metadata=SHAPE)  # longest sequence the model reads (GPT-2: 1024)
    # GPT-2's 50,257 tokens (tokenizer.GPT2_VOCAB_SIZE) padded to a multiple of 64, because matrix
    # multiplies on GPUs run faster on such shapes; the extra rows never win a sample.
    vocab_size: int = field(default=50304, metadata=SHAPE)  # output vocabulary: GPT-2's 50,257 tokens padded to a multiple of 64 for speed
    n_layer: int = field(default=12, metadata=SHAPE_BY_LADDER)  # number of transformer blocks
    n_head: int = field(default=12, metadata=SHAPE_BY_LADDER)  # attention heads per block; must divide n_embd
    n_embd: int = field(default=768, metadata=SHAPE_BY_LADDER)  # width of the residual stream
    dropout: float = field(default=0.0, metadata={"role": "applied", "ladder": False})  # dropout probability; 0 for pretraining, try 0.1 when fine-tuning
    bias: bool = field(default=True, metadata=SHAPE)  # biases in Linear and LayerNorm layers, as in GPT-2


# How many logits the fused loss computes at once, by device type. CPU: 2**22 float32 values (16 MB),
# e.g. 83 rows of GPT-2's 50,304-wide vocabulary; slices this small stay under glibc's largest mmap
# threshold (32 MB), so each slice reuses the memory of the previous one (measured: docs/measurements.md).
# CUDA: 2**29 values (2 GiB of float32 logits), so a GPT-2 micro-batch of 64 x 1,024 tokens is 7 slices
# of ~10,700 rows: each slice's matmul fills the GPU, and torch.compile unrolls only 7 of them.
LOSS_SLICE_VALUES = {"cpu": 2**22, "cuda": 2**29}


def loss_slice_rows(device_type, vocab_size):
    """Rows of hidden states per slice of the fused loss on this kind of device."""
    return max(1, LOSS_SLICE_VALUES.get(device_type, LOSS_SLICE_VALUES["cpu"]) // vocab_size)


def choose_loss_path(setting, device_type, compiled):
    """train.loss_path resolved: "chunked" or "full" (see GPT.forward). "auto" picks what was measured
    fastest (docs/measurements.md): under torch.compile on CUDA, "full" (inductor fuses the softmax and
    the loss into few passes over bf16 logits; GPT-2 124M on an H100: 559k tokens/s against 537k chunked,
    for 3 GiB more memory); everywhere else "chunked" (eager CUDA: the same speed without the 37 GiB of
    float32 logits and their gradient; CPU: 1.5x faster than the full logits)."""
    if setting != "auto":
        return setting
    return "full" if device_type == "cuda" and compiled else "chunked"


def loss_slices(rows, vocab_size, device_type):
    """Slices per micro-step: the number of loop iterations torch.compile unrolls into the graph."""
    return -(-rows // loss_slice_rows(device_type, vocab_size))


class ChunkedCrossEntropy(torch.autograd.Function):
    """The output layer and the mean cross-entropy in one step, a slice of rows at a time.

    `F.cross_entropy(hidden @ weight.T, targets)` writes a (tokens x vocabulary) float32 tensor, reads
    it for the softmax, and writes its gradient again in the backward pass: for the classroom model
    that is 206 MB per step, for GPT-2 (124M) at 64 x 1,024 tokens 13 GB. Here each slice of rows
    computes its logits, its loss, and at once its gradients (softmax minus one-hot, divided by the
    number of scored tokens), then is thrown away; the backward pass only scales the stored gradients.
    The same sums as the full computation (tested to float tolerance, float32 and bf16 autocast),
    padded vocabulary rows included: they are rows of the tied embedding and get their true gradient.
    Targets of -1 are not scored (`ignore_index=-1`)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, need_grad):
        device_type = hidden.device.type
        # Under autocast the matmuls run in its dtype, as the unfused nn.Linear would; sums stay float32.
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        scored = targets != -1
        n_scored = scored.sum()
        with torch.autocast(device_type, enabled=False):
            w = weight.to(dtype)
            loss_sum = torch.zeros((), device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if need_grad else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
            for start in range(0, hidden.size(0), chunk_rows):
                h, t = hidden[start:start + chunk_rows].to(dtype), targets[start:start + chunk_rows]
                s, safe_t = scored[start:start + chunk_rows], t.clamp(min=0)
                logits = (h @ w.t()).float()
                target_logit = logits.gather(1, safe_t[:, None])
                # log-sum-exp with one exp pass, kept for the gradient: exp(logits - max) / its sum is the softmax.
                top = logits.amax(dim=1, keepdim=True)
                exp = logits.sub_(top).exp_()
                total = exp.sum(dim=1, keepdim=True)
                loss_sum += ((total.log() + top - target_logit).squeeze(1) * s).sum()
                if need_grad:  # d(mean loss)/d(logits) = (softmax - one_hot(target)) / n_scored
                    weight_of_row = s[:, None] / n_scored
                    g = exp.mul_(weight_of_row / total)
                    g.scatter_add_(1, safe_t[:, None], -weight_of_row)
                    g = g.to(dtype)
                    grad_hidden[start:start + chunk_rows] = g @ w
                    if dtype == torch.float32:
                        grad_weight.addmm_(g.t(), h)
                    else:
                        grad_weight += (g.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum / n_scored

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss, None, None, None


def chunked_cross_entropy(hidden, weight, targets):
    """Mean cross-entropy of `hidden @ weight.T` against `targets` (-1: not scored), never holding the
    full logits. hidden: (tokens, n_embd); weight: (vocabulary, n_embd); targets: (tokens,)."""
    # Whether a backward pass can follow is decided here: inside forward() grad mode is always off, and
    # ctx.needs_input_grad is True for a parameter even under torch.no_grad(). Without this, every
    # validation pass would also compute the gradients (twice the output layer's work, for nothing).
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return ChunkedCrossEntropy.apply(hidden, weight, targets, loss_slice_rows(hidden.device.type, weight.size(0)),
                                     need_grad)


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
        self.loss_path = "chunked"  # how forward computes the training loss: "chunked" or "full" (see forward)
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

    def forward(self, idx, targets=None, kv_cache=None, return_logits=None):
        """(logits, loss). Without `targets`: the logits of every position, loss None. With `targets`:
        the mean cross-entropy where targets are not -1, and logits None: through the fused chunked loss
        (`loss_path = "chunked"`, the default: the full logits are never built), or through the full
        logits and F.cross_entropy (`"full"`, what nanoGPT does). `return_logits=True` asks for both,
        computed the full way. train.py sets `loss_path` from train.loss_path."""
        B, T = idx.size()
        x = self.hidden_states(idx, kv_cache)
        if targets is not None and not return_logits and self.loss_path == "chunked":
            return None, chunked_cross_entropy(x.view(B * T, -1), self.lm_head.weight, targets.reshape(-1))
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1
            )
        return (logits if return_logits or targets is None else None), loss

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
