"""Wrong answers to the exercises of training it: the schedule (1), accumulation (2), FLOPs and MFU
(4), a metric (5), the AdamW update (12), clipping (13), autocast (17) and a range test (22): each
the kind of mistake a student makes, each failing in one sentence that fits the mistake, naming what
differs and what to do. Each is written into a copy of the answer file
(test_exercises.answer_folder) and graded as a student's would be, in a process of its own."""

import pytest
import torch  # noqa: F401 - a wrong answer's default argument

from test_exercises import answer_folder, failed_with, ids, needs_task_data

# The wrong answers are whole functions, copied into the answer file (with the imports of
# test_exercises.HEADER, and the answer file's own names: TrainState, Task, parts, KVCache,
# filter_logits, ...).


# The wrong answers are whole functions, copied into the answer file (with the imports of
# test_exercises.HEADER, and the answer file's own names: TrainState, Task, rte).


def cosine_without_the_step_offset(schedule, n):  # progress from n - W, not n - 1 - W
    if schedule.kind != "cosine":
        return schedule.lr_at(n)
    T, W = schedule.total_steps, schedule.warmup_steps
    if n <= W:
        return schedule.lr * n / W
    progress = min(1.0, (n - W) / max(1, T - W))
    return (
        schedule.min_lr + (schedule.lr - schedule.min_lr) * (1 + math.cos(math.pi * progress)) / 2
    )


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


def flops_without_attention(model):
    c = model.config
    return 6 * (model.num_params(non_embedding=True) + c.n_embd * c.vocab_size)


def mfu_of_all_devices(flops_per_token, tokens_per_sec, world_size, peak_flops):
    return flops_per_token * tokens_per_sec / peak_flops


def record_a_python_float(recorder, model, weights_before):
    change = sum(((p.detach() - weights_before[n]) ** 2).sum() for n, p in model.named_parameters())
    size = sum((w**2).sum() for w in weights_before.values())
    recorder.record_metric("optim/update_ratio", (change / size).sqrt().item())


def record_summed_over_ranks(recorder, model, weights_before):
    change = sum(((p.detach() - weights_before[n]) ** 2).sum() for n, p in model.named_parameters())
    size = sum((w**2).sum() for w in weights_before.values())
    recorder.record_metric("optim/update_ratio", (change / size).sqrt(), reduce="sum")


def record_item_sums_then_a_tensor(recorder, model, weights_before):
    # the right value, through the host
    change = sum(
        ((p.detach() - weights_before[n]) ** 2).sum().item() for n, p in model.named_parameters()
    )
    size = sum((w**2).sum().item() for w in weights_before.values())
    recorder.record_metric(
        "optim/update_ratio", torch.tensor((change / size) ** 0.5), reduce="mean"
    )


# torch's own .item(), kept when the answer file loads, before the check's spies are in
def record_with_items_kept_from_import(recorder, model, weights_before, _item=torch.Tensor.item):
    change = sum(
        _item(((p.detach() - weights_before[n]) ** 2).sum()) for n, p in model.named_parameters()
    )
    size = sum(_item((w**2).sum()) for w in weights_before.values())
    recorder.record_metric(
        "optim/update_ratio", torch.tensor((change / size) ** 0.5), reduce="mean"
    )


def record_mean_of_ratios(recorder, model, weights_before):
    # each tensor's ratio, averaged: another number
    ratios = [
        (p.detach() - weights_before[n]).norm() / weights_before[n].norm()
        for n, p in model.named_parameters()
    ]
    recorder.record_metric("optim/update_ratio", torch.stack(ratios).mean())


# The wrong answers are whole functions, copied into the answer file (with the imports of
# test_exercises.HEADER, and the answer file's own names: parts, CausalSelfAttention, MLP, KVCache,
# filter_logits, ...).


def adamw_with_l2_decay(
    param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay
):
    grad = grad + weight_decay * param  # Adam with L2: the decay goes through the moments
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1**step))


def adamw_not_in_place(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    param = param * (1 - lr * weight_decay)  # a new tensor: the caller's param never changes
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param = param - lr / (1 - beta1**step) * exp_avg / denominator


def adamw_with_moments_not_in_place(
    param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay
):
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad  # new tensors: the next step reads the old zeros
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    param.mul_(1 - lr * weight_decay)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1**step))


def clip_each_tensor(parameters, max_norm):
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    for grad in grads:
        grad.mul_((max_norm / (grad.norm() + 1e-6)).clamp(max=1.0))
    return total


def clip_up_to_the_limit_too(parameters, max_norm):  # below the limit, the gradients grow to it
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    for grad in grads:
        grad.mul_(max_norm / (total + 1e-6))
    return total


def bf16_step_of_a_model_cast_back(gpt, x, y):
    gpt.to(torch.bfloat16)  # the whole model in bfloat16 for the step, then float32 again
    logits = gpt(x)
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1
    )
    loss.backward()
    gpt.to(torch.float32)
    return loss.detach()


def bf16_step_of_a_model_cast_back_far_off(gpt, x, y):
    # the same, and a loss that differs beyond the check's tolerance, as a whole-bfloat16 model's loss can on some
    # draws (1 in 200): the cast is the cause, and the sentence names it, not the loss
    return bf16_step_of_a_model_cast_back(gpt, x, y) * 1.01


def bf16_modules_with_the_layernorms(gpt):
    return {
        name
        for name, module in gpt.named_modules()
        if isinstance(module, (nn.Linear, nn.LayerNorm))
        or (name.endswith((".attn", ".mlp", ".gelu", "resid_dropout", "mlp.dropout")))
    }


def bf16_step_without_the_upcast(gpt, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = gpt(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))  # in bfloat16
    loss.backward()
    return loss.detach().float()


def bf16_step_without_autocast(gpt, x, y):
    logits = gpt(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    return loss.detach()


def bf16_step_of_a_bf16_model(gpt, x, y):
    gpt.to(torch.bfloat16)
    logits = gpt(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    return loss.detach()


def suggest(lrs, losses, tenth=True):
    average, best, best_lr = 0.0, float("inf"), lrs[0]
    for i, (lr, loss) in enumerate(zip(lrs, losses), 1):
        average = 0.9 * average + 0.1 * loss
        smoothed = average / (1 - 0.9**i)
        if smoothed > 4 * best:
            break
        if smoothed < best:
            best, best_lr = smoothed, lr
    return best_lr / 10 if tenth else best_lr


def suggest_the_minimum_itself(lrs, losses):
    return suggest(lrs, losses, tenth=False)


def suggest_from_the_raw_losses(lrs, losses):
    return lrs[losses.index(min(losses))] / 10


def suggest_without_stopping(lrs, losses):
    average, best, best_lr = 0.0, float("inf"), lrs[0]
    for i, (lr, loss) in enumerate(zip(lrs, losses), 1):  # reads on past the divergence
        average = 0.9 * average + 0.1 * loss
        if average / (1 - 0.9**i) < best:
            best, best_lr = average / (1 - 0.9**i), lr
    return best_lr / 10


# (exercise, {answer function, or Class.method: the wrong one; "_name": a helper it calls}, words)
WRONG = [
    (1, {"lr_at": cosine_without_the_step_offset}, "check the cosine decay"),
    (
        2,
        {"accumulate_gradients": summed_not_averaged},
        "divide each micro-step's loss by the number of micro-steps",
    ),
    (2, {"accumulate_gradients": loss_with_its_graph}, "return loss.detach()"),
    (4, {"flops_per_token": flops_without_attention}, "the difference is attention's 12 x n_layer"),
    (4, {"mfu": mfu_of_all_devices}, "divide by world_size"),
    (5, {"record_update_ratio": record_a_python_float}, "record the tensor itself"),
    (5, {"record_update_ratio": record_summed_over_ranks}, "logs twice the ratio"),
    (5, {"record_update_ratio": record_item_sums_then_a_tensor}, "calls .item() on a tensor"),
    (5, {"record_update_ratio": record_with_items_kept_from_import}, "calls .item() on a tensor"),
    (
        5,
        {"record_update_ratio": record_mean_of_ratios},
        "at step 1 metrics.jsonl has optim/update_ratio",
    ),
    (12, {"adamw_update": adamw_with_l2_decay}, "the weight decay is decoupled"),
    (12, {"adamw_update": adamw_not_in_place}, "update param in place"),
    (
        12,
        {"adamw_update": adamw_with_moments_not_in_place},
        "updated in place (the next step reads it)",
    ),
    (13, {"clip_gradients": clip_each_tensor}, "one factor for all"),
    (13, {"clip_gradients": clip_up_to_the_limit_too}, "only when that is below 1"),
    (17, {"bf16_modules": bf16_modules_with_the_layernorms}, "keeps normalisations in float32"),
    (17, {"bf16_step": bf16_step_without_the_upcast}, "upcast the logits to float32"),
    (17, {"bf16_step": bf16_step_without_autocast}, "run the forward under torch.autocast"),
    (
        17,
        {"bf16_step": bf16_step_of_a_bf16_model},
        "autocast casts each matmul's inputs, never the model",
    ),
    (17, {"bf16_step": bf16_step_of_a_model_cast_back}, "even if cast back after"),
    (17, {"_cast_back": bf16_step_of_a_model_cast_back, "bf16_step": bf16_step_of_a_model_cast_back_far_off},
     "even if cast back after"),
    (22, {"suggest_lr": suggest_the_minimum_itself, "_suggest": suggest}, "suggest a tenth of it"),
    (22, {"suggest_lr": suggest_from_the_raw_losses}, "smooth the losses first"),
    (
        22,
        {"suggest_lr": suggest_without_stopping},
        "stop reading once the smoothed loss exceeds 4 times",
    ),
]


@pytest.mark.parametrize("number,wrong,words", WRONG, ids=ids(WRONG))
def test_a_wrong_answer_fails_in_one_sentence_that_fits_the_mistake(
    number, wrong, words, data_root, tmp_path
):
    needs_task_data(number)
    failed_with(number, answer_folder(tmp_path, number, wrong), words, data_root)
