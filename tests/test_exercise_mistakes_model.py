"""Wrong answers to the exercises of building the model: the causal mask (3), GPT-2's parts (10) and
the capstone (16): each the kind of mistake a student makes, each failing in one sentence that fits
the mistake, naming what differs and what to do. Each is written into a copy of the answer file
(test_exercises.answer_folder) and graded as a student's would be, in a process of its own."""

import pytest
import torch  # noqa: F401 - a wrong answer's default argument

from test_exercises import answer_folder, failed_with, ids, needs_task_data

# The wrong answers are whole functions, copied into the answer file (with the imports of
# test_exercises.HEADER, and the answer file's own names: TrainState, Task, parts, KVCache,
# filter_logits, ...).


def attention_without_a_mask(attn, x):
    B, T, C = x.size()
    q, k, v = (
        t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2)
    )
    weights = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(-1)
    return attn.c_proj((weights @ v).transpose(1, 2).reshape(B, T, C))


def attention_unscaled(attn, x):
    B, T, C = x.size()
    q, k, v = (
        t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2)
    )
    scores = (q @ k.transpose(-2, -1)).masked_fill(
        ~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")
    )
    return attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


def attention_without_the_diagonal(attn, x):
    B, T, C = x.size()
    q, k, v = (
        t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2)
    )
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1), float("-inf"))
    return attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


def init_without_the_residual_scaling(module, n_layer):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        torch.nn.init.zeros_(module.bias)


def block_without_the_residual(block, x, kv_cache=None, attn_mask=None):
    return block.mlp(block.ln_2(block.attn(block.ln_1(x), kv_cache, attn_mask)))


def loss_shifted_again(logits, targets):
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)), targets[:, 1:].reshape(-1), ignore_index=-1
    )


def embeddings_not_tied(gpt):
    pass


def loss_counted_twice(logits, targets):  # the right value, twice the gradient
    loss = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
    )
    return loss + (loss - loss.detach())


def loss_with_a_detached_normaliser(logits, targets):
    # the right value, the softmax's term of the gradient gone
    log_probs = logits - logits.logsumexp(dim=-1, keepdim=True).detach()
    scored = targets != -1
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * scored).sum() / scored.sum()


def mlp_of_a_detached_input(module, x):
    return module.c_proj(module.gelu(module.c_fc(x.detach())))


def attention_of_unscaled_scores(q, k, v, allowed=None, dropout=0.0):
    Tq, Tk = q.size(-2), k.size(-2)
    if allowed is None:
        allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=Tk - Tq)
    return (q @ k.transpose(-2, -1)).masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def attention_blind_to_the_cache(q, k, v, allowed=None, dropout=0.0):
    # a square's mask: new queries see the first keys
    if allowed is None:
        allowed = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def block_built_attention_first(self, config):
    nn.Module.__init__(self)
    self.attn = CausalSelfAttention(config)
    self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
    self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
    self.mlp = MLP(config)


def gpt_built_output_layer_first(self, config, loss_path="chunked"):
    nn.Module.__init__(self)
    self.config, self.loss_path = config, loss_path
    self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
    self.transformer = nn.ModuleDict(dict(
        wte=nn.Embedding(config.vocab_size, config.n_embd),
        wpe=nn.Embedding(config.block_size, config.n_embd), drop=nn.Dropout(config.dropout),
        h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
        ln_f=nn.LayerNorm(config.n_embd, bias=config.bias)))
    parts.tie_weights(self)
    self.apply(lambda module: parts.init_weights(module, config.n_layer))


def hidden_states_from_position_0(self, idx, kv_cache=None, pos=None, attn_mask=None):
    x = self.transformer.drop(parts.embed(self, idx))
    for block in self.transformer.h:
        x = block(x, kv_cache, attn_mask)
    return self.transformer.ln_f(x)


def hidden_states_blind_to_packed_rows(self, idx, kv_cache=None, pos=None, attn_mask=None):
    x = self.transformer.drop(parts.embed(self, idx, 0 if kv_cache is None else kv_cache.length))
    for (
        block
    ) in (
        self.transformer.h
    ):  # pos and attn_mask never used: hellaswag_eval.py's packed rows go wrong
        x = block(x, kv_cache)
    return self.transformer.ln_f(x)


def attention_forward_without_its_dropout(self, x, kv_cache=None, attn_mask=None):
    B, T, C = x.size()
    q, k, v = self.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
    if kv_cache is not None:
        k, v = kv_cache.append(k, v)
    # no dropout on the weights
    y = attention(q, k, v, attn_mask).transpose(1, 2).contiguous().view(B, T, C)
    return self.resid_dropout(self.c_proj(y))


# (exercise, {answer function, or Class.method: the wrong one; "_name": a helper it calls}, words)
WRONG = [
    (3, {"causal_self_attention": attention_without_a_mask}, "mask the future"),
    (3, {"causal_self_attention": attention_unscaled}, "sqrt(head size)"),
    (3, {"causal_self_attention": attention_without_the_diagonal}, "keep the diagonal"),
    (10, {"init_weights": init_without_the_residual_scaling}, "from normal(0, 0.02 / sqrt(2 x"),
    (
        10,
        {"block_forward": block_without_the_residual},
        "add each sub-layer's output back to its input",
    ),
    (10, {"next_token_loss": loss_shifted_again}, "do not shift them again"),
    (10, {"tie_weights": embeddings_not_tied}, "make them one Parameter"),
    (
        10,
        {"next_token_loss": loss_counted_twice},
        "the gradient of the logits is 2 times model.py's",
    ),
    (10, {"next_token_loss": loss_with_a_detached_normaliser}, "a term of the gradient is missing"),
    (10, {"mlp": mlp_of_a_detached_input}, "no gradient reaches its input x"),
    (16, {"attention": attention_of_unscaled_scores}, "divide the scores by sqrt(head size)"),
    (16, {"attention": attention_blind_to_the_cache}, "tril(diagonal=Tk - Tq)"),
    (16, {"Block.__init__": block_built_attention_first}, "create the modules in model.py's order"),
    # (the tied weight then goes by lm_head.weight: the names are right, the order is not)
    (16, {"GPT.__init__": gpt_built_output_layer_first}, "create the modules in model.py's order"),
    (
        16,
        {"GPT.hidden_states": hidden_states_from_position_0},
        "start the positions at kv_cache.length",
    ),
    (
        16,
        {"GPT.hidden_states": hidden_states_blind_to_packed_rows},
        "embed each token at its given `pos`",
    ),
    (
        16,
        {"CausalSelfAttention.forward": attention_forward_without_its_dropout},
        "the attention weights",
    ),
]


@pytest.mark.parametrize("number,wrong,words", WRONG, ids=ids(WRONG))
def test_a_wrong_answer_fails_in_one_sentence_that_fits_the_mistake(
    number, wrong, words, data_root, tmp_path
):
    needs_task_data(number)
    failed_with(number, answer_folder(tmp_path, number, wrong), words, data_root)
