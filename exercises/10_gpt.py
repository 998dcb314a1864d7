"""Exercise 10, the capstone: build GPT-2 yourself, then train it with the real trainer.

Goal: write the parts of GPT-2 that make it GPT-2: the MLP, the pre-LayerNorm residual block, the
token + position embeddings with the output layer tied to the token embedding, GPT-2's initialisation,
and the cross-entropy of the next token. The classes at the bottom of this file assemble your functions
into a `GPT` the trainer can train: `python train.py --train.model_module=exercises/10_gpt.py` trains
your model instead of model.py's (attention is given: exercise 3 builds it).
In the project: model.py (`MLP`, `Block`, `GPT.__init__`, `GPT._init_weights`, `GPT.hidden_states`, and
`GPT.forward`'s full path: `F.cross_entropy`).
Check: python exercises/check.py 10
(each function against model.py on random inputs; then train.py trains your GPT and model.py's on the
same seed and data, and your loss curve must match: to 1e-5 at step 1, 1e-3 after; the sums of your
cross-entropy may run in another order than PyTorch's)
Hints, one level at a time: python exercises/check.py 10 --hint
"""

import torch
import torch.nn as nn

import model
from model import CausalSelfAttention

HINTS = [
    "GPT-2 is nanoGPT's model.py: read its MLP, Block and GPT classes once, then write each function here from "
    "what it must compute, not by copying.",
    "mlp: c_fc, then GELU (the tanh approximation, module.gelu), then c_proj. block_forward: x + attn(ln_1(x)), "
    "then that + mlp(ln_2(that)). embed: wte(idx) + wpe(positions 0..T-1). tie_weights: one Parameter shared. "
    "init_weights: normal(0, 0.02) for Linear and Embedding weights, zero biases, and std 0.02 / sqrt(2 n_layer) "
    "for the layers marked residual_projection. next_token_loss: log_softmax, pick the target's log-probability, "
    "average over the targets that are not -1, negated.",
]


def mlp(module, x):
    """The MLP of a block: widen each position's vector 4x, a non-linearity, and back. `module` has
    `c_fc` (n_embd -> 4 n_embd), `gelu` and `c_proj` (4 n_embd -> n_embd); x is (B, T, n_embd)."""
    return module.c_proj(module.gelu(module.c_fc(x)))


def block_forward(block, x):
    """One transformer block, pre-LayerNorm: each of attention and the MLP reads a normalised copy of the
    residual stream and adds its output back to it. `block` has ln_1, attn, ln_2, mlp."""
    x = x + block.attn(block.ln_1(x))
    return x + block.mlp(block.ln_2(x))


def embed(gpt, idx):
    """The input of the first block: each token's embedding plus its position's. `gpt.transformer` has
    `wte` (vocabulary x n_embd) and `wpe` (block_size x n_embd); idx is (B, T) token ids."""
    positions = torch.arange(idx.size(1), device=idx.device)
    return gpt.transformer.wte(idx) + gpt.transformer.wpe(positions)


def tie_weights(gpt):
    """Make the output layer `gpt.lm_head` and the token embedding `gpt.transformer.wte` one and the same
    weight (Press & Wolf 2017, as GPT-2): a token's input vector is the one its logit is scored with."""
    gpt.transformer.wte.weight = gpt.lm_head.weight


def init_weights(module, n_layer):
    """GPT-2's initialisation of one module (GPT.__init__ applies it to every module, in order): what the
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


# ----------------------------------------------------------------------------- given: the assembly
# The same modules as model.py, built in the same order (so the same seed gives the same weights and a
# checkpoint's names match), calling your functions above.


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(mlp(self, x))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, attn_mask=None):
        if kv_cache is not None or attn_mask is not None:
            raise NotImplementedError("your GPT trains and samples without a KV cache; the task scores need model.py")
        return block_forward(self, x)


class GPT(nn.Module):
    def __init__(self, config, loss_path="chunked"):
        super().__init__()
        self.config, self.loss_path = config, loss_path  # (your loss is the plain one, whatever the path)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd), wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout), h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        tie_weights(self)
        self.apply(lambda module: init_weights(module, config.n_layer))

    def hidden_states(self, idx, kv_cache=None, pos=None, attn_mask=None):
        x = self.transformer.drop(embed(self, idx))
        for block in self.transformer.h:
            x = block(x, kv_cache, attn_mask)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, kv_cache=None):
        """The logits without `targets`; the mean loss with them (model.py's rule)."""
        logits = self.lm_head(self.hidden_states(idx, kv_cache))
        return logits if targets is None else next_token_loss(logits, targets)

    # What the trainer asks every model (model.WHAT_THE_TRAINER_ASKS): model.py's answers, which read the model
    # by its module types, so they fit this GPT as they fit model.py's.
    blocks = model.GPT.blocks
    param_groups, num_params, flops_per_token = model.GPT.param_groups, model.GPT.num_params, model.GPT.flops_per_token
