"""Exercises 1 to 11 fail on wrong answers, each the kind of mistake a student makes, in one sentence that fits
the mistake: it names what differs and what to do. Each wrong answer is written into a copy of the answer file
(test_exercises.py's answer_folder) and graded as a student's would be, in a process of its own. (Exercises 12
to 23: test_exercises_wrong_12_to_23.py.)"""

import pytest
import torch

from test_exercises import answer_folder, failed_with, ids, needs_task_data

# The wrong answers are whole functions, copied into the answer file (with the imports of test_exercises.HEADER,
# and the answer file's own names: TrainState, Task, rte).


def cosine_without_the_step_offset(schedule, n):  # progress from n - W, not n - 1 - W
    if schedule.kind != "cosine":
        return schedule.lr_at(n)
    T, W = schedule.total_steps, schedule.warmup_steps
    if n <= W:
        return schedule.lr * n / W
    progress = min(1.0, (n - W) / max(1, T - W))
    return schedule.min_lr + (schedule.lr - schedule.min_lr) * (1 + math.cos(math.pi * progress)) / 2


def summed_not_averaged(model, micro_batches):
    total = torch.zeros(())
    for x, y in micro_batches:
        loss = model(x, y)
        loss.backward()
        total += loss.detach() / len(micro_batches)
    return total


def loss_with_its_graph(model, micro_batches):
    total = 0
    for x, y in micro_batches:
        loss = model(x, y)
        (loss / len(micro_batches)).backward()
        total = total + loss / len(micro_batches)
    return total


def attention_without_a_mask(attn, x):
    B, T, C = x.size()
    q, k, v = (t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2))
    weights = (q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).softmax(-1)
    return attn.c_proj((weights @ v).transpose(1, 2).reshape(B, T, C))


def attention_unscaled(attn, x):
    B, T, C = x.size()
    q, k, v = (t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2))
    scores = (q @ k.transpose(-2, -1)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


def attention_without_the_diagonal(attn, x):
    B, T, C = x.size()
    q, k, v = (t.view(B, T, attn.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(-1), float("-inf"))
    return attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


def flops_without_attention(model):
    c = model.config
    return 6 * (model.num_params(non_embedding=True) + c.n_embd * c.vocab_size)


def mfu_of_all_devices(flops_per_token, tokens_per_sec, world_size, peak_flops):
    return flops_per_token * tokens_per_sec / peak_flops


def record_a_python_float(recorder, model, weights_before):
    change = sum(((p.detach() - weights_before[n]) ** 2).sum() for n, p in model.named_parameters())
    size = sum((w ** 2).sum() for w in weights_before.values())
    recorder.record_metric("optim/update_ratio", (change / size).sqrt().item())


def record_summed_over_ranks(recorder, model, weights_before):
    change = sum(((p.detach() - weights_before[n]) ** 2).sum() for n, p in model.named_parameters())
    size = sum((w ** 2).sum() for w in weights_before.values())
    recorder.record_metric("optim/update_ratio", (change / size).sqrt(), reduce="sum")


def record_item_sums_then_a_tensor(recorder, model, weights_before):  # the right value, through the host
    change = sum(((p.detach() - weights_before[n]) ** 2).sum().item() for n, p in model.named_parameters())
    size = sum((w ** 2).sum().item() for w in weights_before.values())
    recorder.record_metric("optim/update_ratio", torch.tensor((change / size) ** 0.5), reduce="mean")


# torch's own .item(), kept when the answer file loads, before the check's spies are in (found by a review of issue 49)
def record_with_items_kept_from_import(recorder, model, weights_before, _item=torch.Tensor.item):
    change = sum(_item(((p.detach() - weights_before[n]) ** 2).sum()) for n, p in model.named_parameters())
    size = sum(_item((w ** 2).sum()) for w in weights_before.values())
    recorder.record_metric("optim/update_ratio", torch.tensor((change / size) ** 0.5), reduce="mean")


def record_mean_of_ratios(recorder, model, weights_before):  # each tensor's ratio, averaged: another number
    ratios = [(p.detach() - weights_before[n]).norm() / weights_before[n].norm() for n, p in model.named_parameters()]
    recorder.record_metric("optim/update_ratio", torch.stack(ratios).mean())


def from_dict_without_the_data_position(saved):
    return TrainState(saved["step"], saved["tokens"], saved["best_val_loss"])


def rng_state_without_torch(generator):
    return {"sample": generator.get_state()}


def set_rng_state_without_torch(state, generator):
    generator.set_state(state["sample"])


def rng_state_of_torch_only(generator):  # Python's and NumPy's generators forgotten
    return {"torch": torch.get_rng_state(), "sample": generator.get_state()}


def set_rng_state_of_torch_only(state, generator):
    torch.set_rng_state(state["torch"])
    generator.set_state(state["sample"])


def rte_without_the_space(doc):
    context = doc["sentence1"] + "\nQuestion: " + doc["sentence2"] + " True or False?\nAnswer:"
    return [(context, "True"), (context, "False")], doc["label"]


def rte_task_of_superglue():
    return Task("glue/rte", ("super_glue", "rte"), rte, "acc_per_char")


def rte_task_scored_by_acc():
    return Task("glue/rte", ("nyu-mll/glue", "rte"), rte, "acc")


def tokens_for_loss_without_the_floor(law, n, loss):  # a loss below E + A / N^alpha is never reached
    return (law["B"] / (loss - law["E"] - law["A"] / n ** law["alpha"])) ** (1 / law["beta"])


def tokens_for_loss_strictly_below(law, n, loss):  # `< 0` where `<= 0` is needed: the floor itself
    rest = loss - law["E"] - law["A"] / n ** law["alpha"]
    if rest < 0:
        return math.inf
    return (law["B"] / rest) ** (1 / law["beta"])


def optimum_without_alpha_and_beta(law, n):
    return (law["B"] * n ** law["alpha"] / law["A"]) ** (1 / law["beta"]) / n


def embeddings_to_muon_too(model, optim):  # Muon would own the embeddings, the output layer with them
    from optimizer import param_groups as project_groups
    groups = project_groups(model, optim)
    if optim.name == "muon":
        embeddings = [model.transformer.wte.weight, model.transformer.wpe.weight]
        for name in ("decay", "no_decay"):
            groups[name] = [p for p in groups[name] if all(p is not e for e in embeddings)]
        groups["muon"] += embeddings
    return groups


def init_without_the_residual_scaling(module, n_layer):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        torch.nn.init.zeros_(module.bias)


def block_without_the_residual(block, x, kv_cache=None, attn_mask=None):
    return block.mlp(block.ln_2(block.attn(block.ln_1(x), kv_cache, attn_mask)))


def loss_shifted_again(logits, targets):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), targets[:, 1:].reshape(-1), ignore_index=-1)


def embeddings_not_tied(gpt):
    pass


def loss_counted_twice(logits, targets):  # the right value, twice the gradient
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
    return loss + (loss - loss.detach())


def loss_with_a_detached_normaliser(logits, targets):  # the right value, the softmax's term of the gradient gone
    log_probs = logits - logits.logsumexp(dim=-1, keepdim=True).detach()
    scored = targets != -1
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * scored).sum() / scored.sum()


def mlp_of_a_detached_input(module, x):
    return module.c_proj(module.gelu(module.c_fc(x.detach())))


def bpe_highest_rank_first(symbols, ranks):
    parts = list(symbols)
    while len(parts) > 1:
        ranked = [(ranks[pair], i) for i, pair in enumerate(zip(parts, parts[1:])) if pair in ranks]
        if not ranked:
            break
        _, i = max(ranked)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


WRONG = [  # (exercise, {answer function: the wrong one}, words the sentence must hold)
    (1, {"lr_at": cosine_without_the_step_offset}, "check the cosine decay"),
    (2, {"accumulate_gradients": summed_not_averaged}, "divide each micro-step's loss by the number of micro-steps"),
    (2, {"accumulate_gradients": loss_with_its_graph}, "return loss.detach()"),
    (3, {"causal_self_attention": attention_without_a_mask}, "mask the future"),
    (3, {"causal_self_attention": attention_unscaled}, "sqrt(head size)"),
    (3, {"causal_self_attention": attention_without_the_diagonal}, "keep the diagonal"),
    (4, {"flops_per_token": flops_without_attention}, "the difference is attention's 12 x n_layer"),
    (4, {"mfu": mfu_of_all_devices}, "divide by world_size"),
    (5, {"record_update_ratio": record_a_python_float}, "record the tensor itself"),
    (5, {"record_update_ratio": record_summed_over_ranks}, "logs twice the ratio"),
    (5, {"record_update_ratio": record_item_sums_then_a_tensor}, "calls .item() on a tensor"),
    (5, {"record_update_ratio": record_with_items_kept_from_import}, "calls .item() on a tensor"),
    (5, {"record_update_ratio": record_mean_of_ratios}, "at step 1 metrics.jsonl has optim/update_ratio"),
    (6, {"trainer_state_from_dict": from_dict_without_the_data_position}, "TrainState.data is {}"),
    (6, {"rng_state": rng_state_without_torch, "set_rng_state": set_rng_state_without_torch},
     "torch's random number generator"),
    (6, {"rng_state": rng_state_of_torch_only, "set_rng_state": set_rng_state_of_torch_only},
     "Python's random generator"),
    (7, {"rte": rte_without_the_space},
     "continuation of choice 0 is 'True', which differs from OLMo's RTE format from its character 0 on"),
    (7, {"rte_task": rte_task_of_superglue}, "SuperGLUE"),
    (7, {"rte_task": rte_task_scored_by_acc}, "which this project calls \"acc_per_char\""),
    (8, {"tokens_for_loss": tokens_for_loss_without_the_floor}, "is never reached (math.inf)"),
    (8, {"tokens_for_loss": tokens_for_loss_strictly_below}, "raised ZeroDivisionError"),
    (8, {"tokens_per_param_at_optimum": optimum_without_alpha_and_beta}, "tokens_per_param_at_optimum(N"),
    (9, {"param_groups": embeddings_to_muon_too}, "transformer.wte.weight is in your 'muon' group"),
    (10, {"init_weights": init_without_the_residual_scaling}, "from normal(0, 0.02 / sqrt(2 x"),
    (10, {"block_forward": block_without_the_residual}, "add each sub-layer's output back to its input"),
    (10, {"next_token_loss": loss_shifted_again}, "do not shift them again"),
    (10, {"tie_weights": embeddings_not_tied}, "make them one Parameter"),
    (10, {"next_token_loss": loss_counted_twice}, "the gradient of the logits is 2 times model.py's"),
    (10, {"next_token_loss": loss_with_a_detached_normaliser}, "a term of the gradient is missing"),
    (10, {"mlp": mlp_of_a_detached_input}, "no gradient reaches its input x"),
    (11, {"bpe_merge": bpe_highest_rank_first},
     "the lowest rank first (the merge GPT-2 learned earliest, not the most frequent"),
]


@pytest.mark.parametrize("number,wrong,words", WRONG, ids=ids(WRONG))
def test_a_wrong_answer_fails_in_one_sentence_that_fits_the_mistake(number, wrong, words, data_root,
                                                                    tmp_path):
    needs_task_data(number)
    failed_with(number, answer_folder(tmp_path, number, wrong), words, data_root)
