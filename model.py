"""GPT-2: its configuration, attention, MLP, block and the GPT itself, then parameter and FLOP counts.

This is the GPT-2 of Radford et al. (2019) as reproduced by nanoGPT: pre-LayerNorm transformer
blocks, learned position embeddings, a GELU(tanh) MLP and an output layer that shares its weights
with the token embedding. `model(idx)` gives the logits, `model(idx, targets)` the loss: train.py
calls the second, sampling and evaluation the first.

What only the model knows stays here, so a fork edits this file alone: which parameters are embeddings,
matrices or gains (`param_groups`, which the optimizer groups by), its blocks (per-layer metrics), its size
and FLOPs. The rest of the trainer names no layer. At the bottom: the chunked loss, the same cross-entropy
computed a slice of rows at a time (`train.loss_path`), which `forward` calls as one visible branch.
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F

# Beside each field, as config.py's settings say it: its role when a run resumes (config.py explains roles; the
# model's shape is what the run *is*), whether ladder.py derives it from the model size, and its range check.
SHAPE = {"role": "identity", "ladder": False, "check": "at least 1"}
SHAPE_BY_LADDER = {**SHAPE, "ladder": True}


@dataclass(slots=True)
class GPTConfig:
    block_size: int = field(default=1024, metadata=SHAPE)  # longest sequence the model reads (GPT-2: 1024)
    # output vocabulary: GPT-2's 50,257 tokens padded to a multiple of 64, as GPU matmuls run faster on such shapes
    vocab_size: int = field(default=50304, metadata=SHAPE)
    n_layer: int = field(default=12, metadata=SHAPE_BY_LADDER)  # number of transformer blocks
    n_head: int = field(default=12, metadata=SHAPE_BY_LADDER)  # attention heads per block; must divide n_embd
    n_embd: int = field(default=768, metadata=SHAPE_BY_LADDER)  # width of the residual stream
    # dropout probability; 0 to pretrain, 0.1 to fine-tune
    dropout: float = field(default=0.0, metadata={"role": "applied", "ladder": False, "check": "in [0, 1)"})
    # biases in Linear and LayerNorm layers, as in GPT-2
    bias: bool = field(default=True, metadata={"role": "identity", "ladder": False})
    # A field you add resumes the runs saved before it: their checkpoints lack the key, which then takes its default.
    # So the default is the model as it was (`n_kv_head: int | None = None`: as many as n_head; `qk_norm = False`).

    def checks(self):
        """Checks across fields, as (whether it holds, the sentence that says what to do when it does not). config.py
        refuses a run with the first that fails, before anything is written; each field's own range is checked
        before these run (so n_head is at least 1 here). A field you add that must agree with others adds its check
        here, e.g. `(self.n_head % self.n_kv_head == 0, f"model.n_head={self.n_head} is not divisible by ...")`."""
        return [
            (self.n_embd % self.n_head == 0,
             f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}; every head gets n_embd / "
             f"n_head dimensions, so pick values that divide."),
        ]


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
        self.loss_path = loss_path  # how forward computes the loss: "chunked" (below) or "full" (F.cross_entropy)
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
        """The logits (B, T, vocabulary) without `targets`; with them, the mean cross-entropy of the next token
        (the loader shifted the targets by one; targets of -1 are not scored)."""
        x = self.hidden_states(idx, kv_cache)
        if targets is None:
            return self.lm_head(x)
        if self.loss_path == "chunked":  # the same loss a slice of rows at a time, never all the logits (below)
            return chunked_cross_entropy(x.reshape(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1))
        logits = self.lm_head(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)

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

    # ------------------------------------------------------------------ what the trainer asks the model

    @property
    def blocks(self):
        """The transformer blocks, in order (per-layer metrics are read from each)."""
        return self.transformer.h

    def param_groups(self):
        """Every parameter once, by what it is; optimizer.py decides from this which ones decay and which
        go to Muon (nanoGPT's `configure_optimizers` decides here too):
          embedding  lookup tables (nn.Embedding); the tied output layer is the token embedding
          output     an output layer with weights of its own (untied)
          matrix     the other weights of two or more dimensions: the matmuls of the blocks
          vector     biases and LayerNorm gains
        Each list is in the model's own parameter order."""
        modules = dict(self.named_modules())
        groups = {"embedding": [], "output": [], "matrix": [], "vector": []}
        for name, p in self.named_parameters():  # a tied weight comes once, under its first name
            owner = modules[name.rpartition(".")[0]]
            kind = ("embedding" if isinstance(owner, nn.Embedding) else "output" if owner is self.lm_head
                    else "matrix" if p.dim() >= 2 else "vector")
            groups[kind].append(p)
        return groups

    def num_params(self, non_embedding=False):
        """Parameter count, a tied weight once. Non-embedding (Kaplan et al. 2020) leaves out the lookup
        tables (token and position embeddings); it is the N in scaling laws, Chinchilla's 20 tokens per
        parameter and the ladder. An untied output layer is a matmul, and counts."""
        groups = self.param_groups()
        kinds = [kind for kind in groups if not (non_embedding and kind == "embedding")]
        return sum(p.numel() for kind in kinds for p in groups[kind])

    def flops_per_token(self):
        """Training FLOPs per token: 6N + 12·L·d·T (PaLM, appendix B).

        6N counts the forward (2N) and backward (4N) matrix multiplies, with N the non-embedding
        parameters plus a tied output layer (the embedding lookup is free, the output matmul is not).
        12·L·d·T is attention's query-key and attention-value products, which have no parameters."""
        c = self.config
        tied = any(p is self.lm_head.weight for p in self.param_groups()["embedding"])
        n = self.num_params(non_embedding=True) + (self.lm_head.weight.numel() if tied else 0)
        return 6 * n + 12 * c.n_layer * c.n_embd * c.block_size


def gpt_class(module="model"):
    """The GPT class that train.model_module names: this file's, or the one in a .py file of your own
    (the course's capstone trains a student's GPT this way). It takes the same GPTConfig and answers what
    the trainer asks a model (WHAT_THE_TRAINER_ASKS), so the rest of the trainer names no layer of it."""
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
    missing = [name for name in WHAT_THE_TRAINER_ASKS if not hasattr(loaded.GPT, name)]
    if missing:
        raise ValueError(f"{module}'s GPT has no {', '.join(missing)}, which the trainer asks every model; give it "
                         f"model.py's (e.g. `param_groups = model.GPT.param_groups`).")
    return loaded.GPT


WHAT_THE_TRAINER_ASKS = ("forward", "blocks", "param_groups", "num_params", "flops_per_token")


# ----------------------------------------------------------------------------- the chunked loss
# The same mean cross-entropy as `F.cross_entropy(lm_head(x), targets)`, computed a slice of rows at a time,
# gradients included, so the (tokens x vocabulary) logits are never held at once: on a CPU that is faster, on
# a GPU it saves their memory. `train.loss_path` chooses; both are tested to float tolerance.

# How many logits the chunked loss computes at once, by device type (why these sizes: docs/measurements.md).
# CPU: 16 MB of float32, small enough that each slice reuses the memory of the one before. CUDA: 2 GiB, so
# a GPT-2 micro-batch is a handful of slices, each big enough to fill the GPU.
LOSS_SLICE_VALUES = {"cpu": 2**22, "cuda": 2**29}


def loss_slice_rows(device_type, vocab_size):
    """Rows of hidden states per slice of the fused loss on this kind of device."""
    return max(1, LOSS_SLICE_VALUES.get(device_type, LOSS_SLICE_VALUES["cpu"]) // vocab_size)


def choose_loss_path(setting, device_type, compiled):
    """train.loss_path resolved to "chunked" or "full". "auto" picks the one measured fastest
    (docs/measurements.md): "full" under torch.compile on CUDA, where inductor fuses the softmax into the
    loss; "chunked" everywhere else, where it is as fast or faster and never holds the full logits."""
    if setting != "auto":
        return setting
    return "full" if device_type == "cuda" and compiled else "chunked"


def loss_slices(rows, vocab_size, device_type):
    """Slices per micro-step: the number of loop iterations torch.compile unrolls into the graph."""
    return -(-rows // loss_slice_rows(device_type, vocab_size))


class ChunkedCrossEntropy(torch.autograd.Function):
    """The output layer and the mean cross-entropy in one step, a slice of rows at a time.

    `F.cross_entropy(hidden @ weight.T, targets)` writes a (tokens x vocabulary) float32 tensor, reads
    it for the softmax, and writes its gradient again in the backward pass. Here each slice of rows
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
