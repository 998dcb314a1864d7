"""GPT-2 (Radford et al. 2019) as nanoGPT reproduces it: pre-LayerNorm blocks, learned position
embeddings, a GELU(tanh) MLP and an output layer tied to the token embedding. `model(idx)` gives the
logits, `model(idx, targets)` the loss; train.py calls the second, sampling the first, and the
evaluations `score_tokens`. All of them make their logits with `logits`, the one seam between the
hidden states and the vocabulary.

What only the model knows stays here, so a fork edits this file alone and the rest of the trainer
names no layer: which parameters are embeddings, matrices or gains (`param_groups`; PARAM_KINDS says
what each kind is to the counts and the optimizer), its blocks (per-layer metrics), its size and
FLOPs. At the bottom: faster ways to forward's loss, the same cross-entropy a slice of rows at a
time (`train.loss_path`), fused into one torch.autograd.Function where `logits` is a plain matmul,
and the check that proves one equal to forward's own line before a run takes it
(choose_fast_loss).
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# Beside each field, as config.py's settings say it: its role when a run resumes (config.py explains
# roles; the model's shape is what the run *is*), whether ladder.py derives it from the model size,
# and its range check.
SHAPE = {"role": "identity", "ladder": False, "check": "at least 1"}
SHAPE_BY_LADDER = {**SHAPE, "ladder": True}


@dataclass(slots=True)
class GPTConfig:
    # longest sequence the model reads (GPT-2: 1024)
    block_size: int = field(default=1024, metadata=SHAPE)
    # output vocabulary: GPT-2's 50,257 tokens padded to a multiple of 64, as GPU matmuls run faster
    # on such shapes
    vocab_size: int = field(default=50304, metadata=SHAPE)
    n_layer: int = field(default=12, metadata=SHAPE_BY_LADDER)  # number of transformer blocks
    # attention heads per block; must divide n_embd
    n_head: int = field(default=12, metadata=SHAPE_BY_LADDER)
    n_embd: int = field(default=768, metadata=SHAPE_BY_LADDER)  # width of the residual stream
    # dropout probability; 0 to pretrain, 0.1 to fine-tune
    dropout: float = field(default=0.0, metadata={"role": "applied", "ladder": False,
                                                  "check": "in [0, 1)"})
    # biases in Linear and LayerNorm layers, as in GPT-2
    bias: bool = field(default=True, metadata={"role": "identity", "ladder": False})
    # A field you add resumes the runs saved before it: their checkpoints lack the key, which then
    #   takes its default.
    # So the default is the model as it was (`n_kv_head: int | None = None`: as many as n_head;
    #   `qk_norm = False`).

    def checks(self):
        """Checks across fields, as (holds, the sentence that says what to do if not): config.py
        refuses a run with the first that fails, before anything is written and after each field's
        own range (so n_head >= 1 here). A field you add that must agree with others adds its check,
        e.g. `(self.n_head % self.n_kv_head == 0, "...")`."""
        return [
            (self.n_embd % self.n_head == 0,
             f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}; every "
             "head gets n_embd / n_head dimensions, so pick values that divide."),
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
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, heads, T, head size)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if kv_cache is not None:
            # Generation feeds one new token at a time: attend to the cached past plus the new keys.
            k, v = kv_cache.append(k, v)
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
            # (A single new token after a cache has nothing in the future to mask.)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=kv_cache is None or T > 1,
                                               dropout_p=self.dropout if self.training else 0.0)
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


@dataclass(frozen=True)
class ParamKind:
    # counts in N, the non-embedding parameters (num_params, flops_per_token, the ladder, plan.py)
    in_n: bool
    muon: bool  # with optim.name=muon, Muon steps it; otherwise (and always with AdamW) AdamW does
    decay: bool | None  # AdamW's weight decay; None: as optim.decay_embeddings says


# What each kind of parameter (GPT.param_groups) is to the counts and the optimizer (optimizer.py).
# Decay only the matrices of matmuls and embeddings, not biases or gains, which shrinking towards
# zero only hurts (GPT-3, nanoGPT); Muon takes the blocks' matrices and leaves the embeddings and
# the output layer to AdamW (modded-nanogpt, nanochat). A fork's own kind adds a row (a model_module
# GPT: `param_kinds = {**model.PARAM_KINDS, "kind": ParamKind(...)}`).
PARAM_KINDS = {
    "embedding": ParamKind(in_n=False, muon=False, decay=None),
    "output": ParamKind(in_n=True, muon=False, decay=True),
    "matrix": ParamKind(in_n=True, muon=True, decay=True),
    "vector": ParamKind(in_n=True, muon=False, decay=False),
    # a bias or gain `logits` adds (a fork's lm_head with bias=True): part of the output layer,
    # which N leaves to num_params_with_output, and no matmul, so in no count of FLOPs
    "output_vector": ParamKind(in_n=False, muon=False, decay=False),
}


class GPT(nn.Module):
    # what each kind of parameter in param_groups is to the trainer (above)
    param_kinds = PARAM_KINDS

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
        # train.loss_path: "chunked" lets train.py look for a faster way to forward's loss, "full"
        # keeps forward's own line on every step
        self.loss_path = loss_path
        # The faster way in use, "fused" or "sliced" (the bottom of this file), set by train.py
        # only where it proved it equal to forward's own line for this model (choose_fast_loss);
        # "": forward's own line. `output_weight` names the fused loss's weight.
        self.fast_loss, self.output_weight = "", ""
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
        """The logits (B, T, vocabulary) without `targets`; with them, the mean cross-entropy of the
        next token (the loader shifted the targets by one; targets of -1 are not scored)."""
        x = self.hidden_states(idx, kv_cache)
        if targets is not None and self.fast_loss:  # the same loss as below, never all the logits
            rows, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)  # (bottom of the file)
            if self.fast_loss == "fused":
                weight = self.get_parameter(self.output_weight)
                return LinearCrossEntropy.apply(rows, weight, targets, torch.is_grad_enabled())
            return chunked_cross_entropy(self.logits, rows, targets, self.config.vocab_size)
        logits = self.logits(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                               ignore_index=-1)

    def logits(self, h):
        """Final hidden states (..., n_embd) to logits (..., vocabulary): the one place they are
        made. The losses, sampling, the evaluations and export-hf's check all call it (the fused
        loss's check too), so a fork that edits the logits here (a soft-cap, a temperature)
        trains, samples and is scored as the same model everywhere."""
        return self.lm_head(h)

    def score_tokens(self, idx, targets, pos=None, attn_mask=None, kv_cache=None, vocab_size=None):
        """The log-probability of each target token (-1: not scored, 0 returned), float32, for
        evaluation. `idx` may pack several sequences in a row: then `pos` gives each token's
        position and `attn_mask` (B, 1, T, past + T) the keys each token may attend to, after the
        keys in `kv_cache`. Only the positions with a target go through `logits`, a slice at a time,
        so the logits are never all held. With `vocab_size`, only the first that many logits enter
        the softmax (the rest pad the vocabulary)."""
        h = self.hidden_states(idx, kv_cache, pos, attn_mask)
        scored = targets != -1
        h, t = h[scored], targets[scored]
        log_probs = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
        step = loss_slice_rows(h.device.type, self.config.vocab_size)
        pieces = [self.logits(h[i:i + step])[:, :vocab_size].float().log_softmax(-1)
                  .gather(1, t[i:i + step, None]).squeeze(1) for i in range(0, h.size(0), step)]
        log_probs[scored] = torch.cat(pieces or [h.new_zeros(0)])
        return log_probs

    def hidden_states(self, idx, kv_cache=None, pos=None, attn_mask=None):
        """The final layer-normed hidden state of each position, before `logits` (pos, attn_mask:
        score_tokens)."""
        T = idx.size(1)
        start = 0 if kv_cache is None else kv_cache.length
        if pos is None:
            assert start + T <= self.config.block_size, f"sequence of {start + T} > block_size"
            pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x, kv_cache, attn_mask)
        return self.transformer.ln_f(x)

    # ------------------------------------------------------------------ what the trainer asks the
    # model

    @property
    def blocks(self):
        """The transformer blocks, in order (per-layer metrics are read from each)."""
        return self.transformer.h

    def param_groups(self):
        """Every parameter once, in the model's order, by its kind (PARAM_KINDS says what each is to
        the trainer; a fork may name a kind of its own once it adds it there):
          embedding  lookup tables (nn.Embedding); the tied output layer is the token embedding
          output     the matrices `logits` multiplies by, but an embedding: an untied output
                     layer, by any name
          matrix     the other weights of two or more dimensions: the matmuls of the blocks (a
                     fork's lookup table held as a bare parameter needs a kind of its own)
          vector     biases and LayerNorm gains
          output_vector  a bias or gain `logits` itself uses (an output layer's bias)"""
        modules = dict(self.named_modules())
        groups = {kind: [] for kind in self.param_kinds}
        output = {id(p) for p in output_parameters(self)}  # what `logits` multiplies by
        for name, p in self.named_parameters():  # a tied weight comes once, under its first name
            owner = modules[name.rpartition(".")[0]]
            kind = ("embedding" if isinstance(owner, nn.Embedding)
                    else "output" if id(p) in output and p.dim() == 2
                    else "output_vector" if id(p) in output and p.dim() < 2
                    else "matrix" if p.dim() >= 2 else "vector")
            groups[kind].append(p)
        return groups

    def num_params(self, non_embedding=False):
        """Parameter count, a tied weight once. Non-embedding (Kaplan et al. 2020) counts only the
        kinds that PARAM_KINDS counts in N: not the lookup tables (token and position embeddings).
        It is the N in scaling laws, Chinchilla's 20 tokens per parameter and the ladder. An untied
        output layer is a matmul, and counts."""
        return sum(p.numel() for _, p, kind in parameter_kinds(self)
                   if kind.in_n or not non_embedding)

    def num_params_with_output(self):
        """N plus a tied output layer: every parameter each token multiplies (nanochat's N; Porian
        et al. 2024 point out that the output layer is real compute; an untied one is already in N).
        The output layer is the matrices `logits` multiplies by (output_parameters; a bias it adds
        multiplies nothing), so a fork that names or ties it otherwise counts as it computes."""
        outside_n = {id(p) for _, p, kind in parameter_kinds(self) if not kind.in_n}
        return self.num_params(non_embedding=True) + sum(p.numel() for p in output_parameters(self)
                                                         if id(p) in outside_n and p.dim() >= 2)

    def flops_per_token(self):
        """Training FLOPs per token: 6N + 12·L·d·T (PaLM, appendix B). 6N counts the forward (2N)
        and backward (4N) matmuls, N the non-embedding parameters plus a tied output layer (the
        embedding lookup is free, the output matmul is not); 12·L·d·T is attention's query-key and
        attention-value products, which have no parameters."""
        c = self.config
        return 6 * self.num_params_with_output() + 12 * c.n_layer * c.n_embd * c.block_size


class ModelError(Exception):
    """A model the trainer cannot use as it is (a fork's kind of parameter without a row in its
    table): one sentence that says what to change. Every entry point prints it without a traceback
    (config.run_command)."""


def output_parameters(model):
    """The parameters `model.logits` computes from, frozen ones too: those that get a gradient, zero
    or not, from the logits of one row of hidden states (none on the meta device). A model FSDP has
    sharded, whose pieces a plain row cannot reach, answers by the names lab/fsdp.py's shard read
    first (`output_names`)."""
    params = list(model.parameters())
    if type(params[0]).__name__ == "DTensor":
        by_name = dict(model.named_parameters())
        return [by_name[name] for name in model.output_names]
    frozen = [p for p in params if not p.requires_grad]
    with torch.inference_mode(False), torch.enable_grad():
        try:
            for p in frozen:
                p.requires_grad_(True)
            first = params[0]
            row = torch.zeros(1, model.config.n_embd, device=first.device, dtype=first.dtype,
                              requires_grad=True)  # (so that its logits need a gradient)
            grads = torch.autograd.grad(model.logits(row).sum(), [row, *params], allow_unused=True)
        finally:
            for p in frozen:
                p.requires_grad_(False)
    return [p for p, grad in zip(params, grads[1:]) if grad is not None]


def parameter_kinds(model):
    """[(name, parameter, ParamKind)] for every parameter of `model`, once, from its `param_groups`.
    A kind PARAM_KINDS does not list, or a parameter in no group, is one sentence naming the
    parameter."""
    names = {id(p): name for name, p in model.named_parameters()}
    kind_of = {}
    table = model.param_kinds
    for kind, params in model.param_groups().items():
        for p in params:
            if kind not in table:
                name = names.get(id(p), "a parameter")
                raise ModelError(f"the model's param_groups puts {name} under the kind {kind!r}, "
                                 f"which its param_kinds (model.PARAM_KINDS) does not list; add a "
                                 f"row for it there (counts in N, Muon, weight decay), or give it "
                                 f"one of {', '.join(table)}.")
            kind_of[id(p)] = kind
    unplaced = [name for name, p in model.named_parameters() if id(p) not in kind_of]
    if unplaced:
        raise ModelError(f"the model's param_groups gives {unplaced[0]} no kind; put every "
                         f"parameter in one of its groups, so the counts and the optimizer know "
                         f"what it is.")
    return [(name, p, table[kind_of[id(p)]]) for name, p in model.named_parameters()]


# ------------------------------------------------------------------------------- the chunked loss
# `F.cross_entropy(logits(x), targets)` a slice of rows at a time, so the (tokens x vocabulary)
# logits are never all held (train.loss_path chooses; tested against the full path). A slice's
# rows, by device type, measured (docs/measurements.md): as many as the matrix kernels need to run
# near their rate, and no more than LOSS_SLICE_VALUES logits hold. On a CPU the logits' matmul (rows
# x width times width x vocabulary) runs well below the cores' rate under about 128 rows; 256 rows
# were fastest at the quick start's and nanoGPT's shapes (51 MB of float32 logits). On CUDA as many
# as 2 GiB of logits hold, so a GPT-2 micro-batch is a handful of slices, each big enough to fill
# the GPU.
LOSS_SLICE_ROWS = {"cpu": 256, "cuda": None}  # None: as many as LOSS_SLICE_VALUES allows
LOSS_SLICE_VALUES = {"cpu": 2**26, "cuda": 2**29}


def loss_slice_rows(device_type, vocab_size):
    """Rows of hidden states per slice of the chunked loss on this kind of device."""
    device_type = device_type if device_type in LOSS_SLICE_VALUES else "cpu"
    most = max(1, LOSS_SLICE_VALUES[device_type] // vocab_size)  # the logits' memory
    return min(most, LOSS_SLICE_ROWS[device_type] or most)


def choose_loss_path(setting, fastest):
    """train.loss_path resolved to "chunked" or "full". "auto" picks `fastest`, the one measured
    fastest on the device (devices.py's table, docs/measurements.md): "full" under
    torch.compile on CUDA, where inductor fuses the softmax into the loss; "chunked" everywhere
    else, as fast or faster and never holding all the logits."""
    return fastest if setting == "auto" else setting


def loss_slices(rows, vocab_size, device_type):
    """Slices per micro-step: the number of loop iterations torch.compile unrolls into the graph."""
    return -(-rows // loss_slice_rows(device_type, vocab_size))


def chunked_cross_entropy(logits, hidden, targets, vocab_size):
    """Mean cross-entropy of `logits(hidden)` against `targets` (-1: not scored), a slice of rows
    at a time, for any `logits` (a soft-cap, a bias) and under torch.compile. Each slice runs
    under activation checkpointing: its backward makes its logits again rather than keep them."""
    rows = loss_slice_rows(hidden.device.type, vocab_size)
    total = sum(checkpoint(slice_loss, logits, h, t, use_reentrant=False)
                for h, t in zip(hidden.split(rows), targets.split(rows)))
    return total / (targets != -1).sum()


def slice_loss(logits, hidden, targets):
    """The summed cross-entropy of one slice of rows, in float32 (as the full path's)."""
    return F.cross_entropy(logits(hidden).float(), targets, ignore_index=-1, reduction="sum")


# How far a faster loss may be from forward's own line and still be the same number, relative:
# (loss, each gradient's norm), ten times the float noise measured between them on a 2-layer model
# on a CPU (the fused loss and the slices sum in another order): 1e-7 and 1e-6 in float32; under
# bf16 autocast 1e-7 and 3e-3, its loss given a hundred times (a GPU's bf16 matmul may round a
# slice otherwise; not measured here). A temperature of 0.999 on the logits is 1e-4 away.
LOSS_NOISE = {"float32": (1e-6, 1e-5), "autocast": (1e-5, 3e-2)}


FAST_LOSS_NAMES = {"fused": "the fused loss", "sliced": "the slices through `logits`"}


def fast_loss_problem(model, x, y, fast, gradients=True):
    """"" where computing the loss `fast` ("fused", "sliced") gives what forward's own loss line
    gives for this model on the micro-batch (x, y), in the mode it is in and with the same random
    numbers for dropout: the loss, and with `gradients` every parameter's gradient, to float noise
    (LOSS_NOISE). Else one sentence saying how far apart. The global random generators end as they
    began, and no .grad is touched: the step that follows is the step a run without the check
    takes."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad and gradients]
    params = [p for _, p in named]
    device, before = x.device, model.fast_loss
    results = []
    try:
        for path in ("", fast):
            model.fast_loss = path
            devices = [] if device.type == "cpu" else [device.index or 0]
            with torch.random.fork_rng(devices, device_type=device.type), \
                    torch.set_grad_enabled(gradients):
                loss = model(x, y)
                grads = torch.autograd.grad(loss, params, allow_unused=True) if params else []
            results.append((loss.detach().float(), grads))
    finally:
        model.fast_loss = before
    (plain, plain_grads), (other, other_grads) = results
    name, gives = FAST_LOSS_NAMES[fast], "give" if fast == "sliced" else "gives"
    loss_noise, gradient_noise = LOSS_NOISE["autocast" if torch.is_autocast_enabled(device.type)
                                            else "float32"]
    compared = [(n, a, b) for (n, _), a, b in zip(named, other_grads, plain_grads)]
    if any((a is None) != (b is None) for _, a, b in compared):
        return f"{name} {gives} another set of gradients than forward's own line"
    compared = [(n, a, b) for n, a, b in compared if a is not None]
    # how far past the noise each is (positive, or NaN: not equal), read in one copy to the host
    excess = torch.stack([abs(other - plain) - loss_noise * abs(plain)] + [
        (a - b).float().norm() - gradient_noise * b.float().norm() for _, a, b in compared])
    excess = excess.tolist()
    if not excess[0] <= 0:
        return (f"{name} {gives} {other.item():.6g} where forward's own line gives "
                f"{plain.item():.6g}")
    for (param_name, _, _), past in zip(compared, excess[1:]):
        if not past <= 0:
            return (f"{name} {gives} the loss forward's own line gives but another gradient of "
                    f"{param_name}")
    return ""


def choose_fast_loss(model, x, y, compiled=False, gradients=True, agree=bool):
    """Decide how `model` computes its loss, on the run's first micro-batch (x, y) in training mode
    (train.py, once, before anything else runs the model), and set it on the model: the fused loss
    where `logits` is a plain matmul by one weight and fast_loss_problem finds it equal to
    forward's own line; else the slices through `logits` where they are; else forward's own line.
    Under torch.compile the fused loss is not tried (the slices are what was measured compiled).
    `agree(ok)` is every rank's verdict (all equal), so that the ranks take one path. Returns why,
    for the start line ("" for a GPT not built on this one, whose forward is all there is)."""
    if not hasattr(model, "fast_loss"):  # a GPT of its own: its forward is all there is
        return ""
    model.fast_loss = ""
    if model.loss_path == "full":  # (auto's choice under torch.compile on CUDA: measured fastest)
        return "as train.loss_path asks"
    model.output_weight = "" if compiled else plain_output_weight(model)
    why = ["under torch.compile the slices, not the fused loss" if compiled else
           f"`logits` is a matmul by {model.output_weight}" if model.output_weight else
           "`logits` is more than a matmul by one weight"]
    candidates = ["fused", "sliced"] if model.output_weight else ["sliced"]
    for fast in candidates:
        problem = fast_loss_problem(model, x, y, fast, gradients)
        if agree(not problem):
            model.fast_loss = fast
            return f"{'; '.join(why)}, and {FAST_LOSS_NAMES[fast]} gave forward's loss"
        why.append(problem or f"another rank found {FAST_LOSS_NAMES[fast]} other than forward's")
    return "; ".join(why[1:])


def plain_output_weight(model):
    """The name of the weight W when `model.logits(h)` is h @ W.T and nothing more, else "": the
    fused loss's first test (choose_fast_loss). `logits` must use one parameter alone, of two
    dimensions, and give exactly what F.linear gives on random rows (autocast off; rows large
    enough that a cap or any other nonlinearity shows, which a model's first logits may be too small
    to show). In doubt, "": the slices, right for any logits."""
    params = output_parameters(model)
    if len(params) != 1 or params[0].dim() != 2:  # a bias, a gain: more than a matmul
        return ""
    weight = params[0]
    name = next(name for name, p in model.named_parameters() if p is weight)
    if type(weight).__name__ == "DTensor":  # sharded (FSDP): only forward gathers it, so only
        return name  # the first micro-batch's whole loss tests it
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        # a generator of its own: a draw from the global one would shift dropout's random numbers
        own = torch.Generator(weight.device).manual_seed(0)
        rows = 100 * torch.randn(8, weight.size(1), device=weight.device, dtype=weight.dtype,
                                 generator=own)
        if not torch.equal(model.logits(rows), F.linear(rows, weight)):
            return ""
    return name


class LinearCrossEntropy(torch.autograd.Function):
    """F.cross_entropy(hidden @ weight.T, targets, ignore_index=-1), a slice of rows at a time:
    the forward pass makes each slice's logits, its loss and both gradients, and the backward
    hands the gradients back (Liger-Kernel's fused linear cross-entropy is the pattern). Where
    F.cross_entropy on all the logits writes a (tokens x vocabulary) float32 tensor, reads it for
    the softmax and writes its gradient, this writes a slice's logits into one buffer that every
    slice reuses, and turns them into their log-softmax and then their gradient in place, two
    passes over them; unlike checkpointed slices, it makes no logits again in the backward
    (docs/measurements.md)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, need_grad):
        device = hidden.device.type
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype  # the matmuls'
        rows = loss_slice_rows(device, weight.size(0))
        cast_hidden, w = hidden.to(dtype), weight.to(dtype)  # once, not once a slice
        n_scored = (targets != -1).sum()
        loss = torch.zeros((), device=hidden.device)
        # float32 for the softmax, as the full path; allocated once, as a large buffer made anew
        # every slice would be handed out and taken back by the kernel each time
        buffer = hidden.new_empty(min(rows, hidden.size(0)), weight.size(0), dtype=torch.float32)
        minus_one = hidden.new_full((buffer.size(0), 1), -1.0, dtype=torch.float32)
        # (an evaluation runs under torch.no_grad(): the loss alone)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
        for start in range(0, hidden.size(0), rows):
            h, t = cast_hidden[start:start + rows], targets[start:start + rows]
            scored, t = (t != -1)[:, None], t.clamp(min=0)[:, None]
            logits = buffer[:h.size(0)]
            if dtype == torch.float32:
                torch.mm(h, w.t(), out=logits)
            else:
                logits.copy_(h @ w.t())
            # As F.cross_entropy: the log-softmax, whose value at the target is minus the loss.
            log_probs = torch.log_softmax(logits, 1, out=logits)
            loss -= (log_probs.gather(1, t) * scored).sum()
            if need_grad:  # d(row's loss)/d(logits) = softmax - one_hot(target), in place
                grad = log_probs.exp_().scatter_add_(1, t, minus_one[:h.size(0)]).to(dtype)
                # the mean's 1 / n_scored (0 on a row not scored) scales the slice's few rows of
                # hidden states, not its logits: one pass over them fewer
                weight_of_row = scored / n_scored
                grad_hidden[start:start + rows] = (grad @ w) * weight_of_row
                if dtype == torch.float32:
                    grad_weight.addmm_(grad.t(), h * weight_of_row)  # in place, no buffer a slice
                else:
                    grad_weight += (grad.t() @ (h * weight_of_row)).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss / n_scored

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype), None, None
