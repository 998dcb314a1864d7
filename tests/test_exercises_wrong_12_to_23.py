"""Exercises 12 to 23 fail on wrong answers, each the kind of mistake a student makes, in one sentence that fits
the mistake (as test_exercises_wrong.py for 1 to 11): the update, data parallelism, the capstone, mixed precision,
the tokenizer, sampling, and reading a run."""

import pytest

from test_exercises import answer_folder, failed_with, ids, needs_task_data

# The wrong answers are whole functions, copied into the answer file (with the imports of test_exercises.HEADER,
# and the answer file's own names: parts, CausalSelfAttention, MLP, KVCache, filter_logits, ...).


def adamw_with_l2_decay(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    grad = grad + weight_decay * param  # Adam with L2: the decay goes through the moments
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1 ** step))


def adamw_not_in_place(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    param = param * (1 - lr * weight_decay)  # a new tensor: the caller's param never changes
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param = param - lr / (1 - beta1 ** step) * exp_avg / denominator


def adamw_with_moments_not_in_place(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad  # new tensors: the next step reads the old zeros
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    param.mul_(1 - lr * weight_decay)
    denominator = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denominator, value=-lr / (1 - beta1 ** step))


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


def every_rank_the_same_sequences(position, rank, world_size, batch_size):
    return list(range(position, position + batch_size))


def broadcast_rank_0s_gradient(model, world_size):
    for p in model.parameters():
        dist.broadcast(p.grad, src=0)


def summed_over_the_ranks(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def attention_of_unscaled_scores(q, k, v, allowed=None, dropout=0.0):
    Tq, Tk = q.size(-2), k.size(-2)
    if allowed is None:
        allowed = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=Tk - Tq)
    return (q @ k.transpose(-2, -1)).masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def attention_blind_to_the_cache(q, k, v, allowed=None, dropout=0.0):  # a square's mask: new queries see the first keys
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


def hidden_states_from_position_0(self, idx, kv_cache=None, pos=None, attn_mask=None):
    x = self.transformer.drop(parts.embed(self, idx))
    for block in self.transformer.h:
        x = block(x, kv_cache, attn_mask)
    return self.transformer.ln_f(x)


def hidden_states_blind_to_packed_rows(self, idx, kv_cache=None, pos=None, attn_mask=None):
    x = self.transformer.drop(parts.embed(self, idx, 0 if kv_cache is None else kv_cache.length))
    for block in self.transformer.h:  # pos and attn_mask never used: hellaswag_eval.py's packed rows go wrong
        x = block(x, kv_cache)
    return self.transformer.ln_f(x)


def attention_forward_without_its_dropout(self, x, kv_cache=None, attn_mask=None):
    B, T, C = x.size()
    q, k, v = self.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
    if kv_cache is not None:
        k, v = kv_cache.append(k, v)
    y = attention(q, k, v, attn_mask).transpose(1, 2).contiguous().view(B, T, C)  # no dropout on the weights
    return self.resid_dropout(self.c_proj(y))


def bf16_step_of_a_model_cast_back(gpt, x, y):
    gpt.to(torch.bfloat16)  # the whole model in bfloat16 for the step, then float32 again
    logits = gpt(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
    loss.backward()
    gpt.to(torch.float32)
    return loss.detach()


def bf16_modules_with_the_layernorms(gpt):
    return {name for name, module in gpt.named_modules() if isinstance(module, (nn.Linear, nn.LayerNorm))
            or (name.endswith((".attn", ".mlp", ".gelu", "resid_dropout", "mlp.dropout")))}


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


def bytes_as_themselves():
    return {b: chr(b) for b in range(256)}


def split_at_spaces(text):
    return text.split(" ")


def pre_tokens_whose_spaces_stay_together(text):  # without \s+(?!\S)
    return regex.findall(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+""", text)


def merges_learned(words, num_merges, weighted=True, later_first=False):  # two mistakes, each a switch
    pieces = {word: list(word) for word in words}
    made = {character: n for n, character in enumerate(sorted({c for word in words for c in word}))}
    merges = []
    for _ in range(num_merges):
        counts = collections.Counter()
        for word, count in words.items():
            for pair in zip(pieces[word], pieces[word][1:]):
                counts[pair] += count if weighted else 1
        sign = 1 if later_first else -1
        best = max(counts, key=lambda pair: (counts[pair], sign * made[pair[0]], sign * made[pair[1]]))
        merges.append(best)
        made.setdefault(best[0] + best[1], len(made) + 256)
        for word, parts in pieces.items():
            merged, i = [], 0
            while i < len(parts):
                if parts[i:i + 2] == list(best):
                    merged.append(best[0] + best[1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            pieces[word] = merged
    return merges


def merges_counting_each_word_once(words, num_merges):
    return merges_learned(words, num_merges, weighted=False)


def merges_breaking_ties_the_other_way(words, num_merges):
    return merges_learned(words, num_merges, later_first=True)


def ddp(model, micro_batches, sync="last", ranks_too=False):  # three mistakes, each a switch
    total = torch.zeros(())
    for i, (x, y) in enumerate(micro_batches):
        quiet = sync == "never" or (sync == "last" and i < len(micro_batches) - 1)
        with model.no_sync() if quiet else nullcontext():
            loss = model(x, y)
            (loss / len(micro_batches) / (dist.get_world_size() if ranks_too else 1)).backward()
        total += loss.detach() / len(micro_batches)
    return total


def ddp_without_no_sync(model, micro_batches):
    return ddp(model, micro_batches, sync="always")


def ddp_all_in_no_sync(model, micro_batches):
    return ddp(model, micro_batches, sync="never")


def ddp_all_in_no_sync_reduced_by_hand(model, micro_batches):  # DDP's all-reduce skipped, then done by hand
    total = ddp(model, micro_batches, sync="never")
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return total


def ddp_on_every_micro_step_counted_as_the_last(model, micro_batches):  # issue 49, hole 5
    for hook in list(model._forward_pre_hooks.values()):  # a micro-step counter, if one hangs on the model: bump it
        for _ in range(len(micro_batches) - 1):
            hook(model, ())
    return ddp(model, micro_batches, sync="always")


def ddp_reduced_by_hand_then_a_bucket_of_its_own_counted(model, micro_batches):  # found by a review of issue 49
    class Bucket:  # what DDP hands its hook, made by hand: one bucket of the gradients already averaged
        def __init__(self, flat):
            self.flat = flat

        def index(self):
            return 0

        def buffer(self):
            return self.flat

    total = ddp_all_in_no_sync_reduced_by_hand(model, micro_batches)
    hook, state = model._comm_hooks[0]  # the hook the check registered, which counts an all-reduce
    hook(state, Bucket(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))).wait()
    return total


def ddp_on_the_last_two_micro_steps(model, micro_batches):  # right gradients, each bucket all-reduced twice
    total = torch.zeros(())
    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 2 else nullcontext():
            loss = model(x, y)
            (loss / len(micro_batches)).backward()
        total += loss.detach() / len(micro_batches)
    return total


def generate_counted_by_the_cache_tokens_from_a_recompute(model, idx, max_new_tokens, temperature=1.0, top_k=None,
                                                          generator=None):
    import sample  # a cached generate run for the counter alone, its tokens thrown away

    sample.generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=None)
    model.transformer.wte._forward_pre_hooks.clear()  # the counter of issue 49 (a hook on wte) sees no more
    return generate_without_a_cache(model, idx, max_new_tokens, temperature, top_k, generator)


def generate_recomputed_with_the_count_put_back(model, idx, max_new_tokens, temperature=1.0, top_k=None,
                                                generator=None):  # found by a review of issue 49
    import sample  # a cached generate run for the count, then a recompute whose count is taken back out

    forward = type(model.transformer.h[0]).forward  # the counting block's: its closure holds the count
    counted = next(cell.cell_contents for cell in forward.__closure__ if isinstance(cell.cell_contents, list))
    sample.generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=None)
    kept = list(counted)
    tokens = generate_without_a_cache(model, idx, max_new_tokens, temperature, top_k, generator)
    counted[:] = kept
    return tokens


def ddp_divided_by_the_ranks_too(model, micro_batches):
    return ddp(model, micro_batches, ranks_too=True)


def generate_without_a_cache(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
    for _ in range(max_new_tokens):
        logits = filter_logits(model(idx[:, -model.config.block_size:])[:, -1, :], top_k=top_k)
        if temperature == 0:
            new = logits.argmax(dim=-1, keepdim=True)
        else:
            new = torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat([idx, new], dim=1)
    return idx


def generate_past_block_size(model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None):
    cache, new = KVCache(model.config.n_layer), idx
    for _ in range(max_new_tokens):
        logits = filter_logits(model(new, kv_cache=cache)[:, -1, :], top_k=top_k)
        if temperature == 0:
            new = logits.argmax(dim=-1, keepdim=True)
        else:
            new = torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1, generator=generator)
        idx = torch.cat([idx, new], dim=1)
    return idx


def suggest(lrs, losses, tenth=True):
    average, best, best_lr = 0.0, float("inf"), lrs[0]
    for i, (lr, loss) in enumerate(zip(lrs, losses), 1):
        average = 0.9 * average + 0.1 * loss
        smoothed = average / (1 - 0.9 ** i)
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
        if average / (1 - 0.9 ** i) < best:
            best, best_lr = average / (1 - 0.9 ** i), lr
    return best_lr / 10


def spikes_after_the_first_jump(losses, threshold, window=50):
    jumps = [step for step in range(11, len(losses) + 1) if losses[step - 1] > losses[step - 2] + threshold]
    return list(range(jumps[0], len(losses) + 1)) if jumps else []


def spikes_against_the_previous_loss(losses, threshold, window=50):
    return [step for step in range(2, len(losses) + 1) if losses[step - 1] > losses[step - 2] + threshold]


def rewind_to_the_checkpoint_before_the_spike(spike_step, checkpoint_steps):
    return max(step for step in checkpoint_steps if step < spike_step)


# (exercise, {answer function, or Class.method: the wrong one; "_name": a helper it calls}, words the sentence holds)
WRONG = [
    (12, {"adamw_update": adamw_with_l2_decay}, "the weight decay is decoupled"),
    (12, {"adamw_update": adamw_not_in_place}, "update param in place"),
    (12, {"adamw_update": adamw_with_moments_not_in_place}, "updated in place (the next step reads it)"),
    (13, {"clip_gradients": clip_each_tensor}, "one factor for all"),
    (13, {"clip_gradients": clip_up_to_the_limit_too}, "only when that is below 1"),
    (14, {"rank_sequences": every_rank_the_same_sequences}, "offset them by the rank"),
    (15, {"average_gradients": broadcast_rank_0s_gradient}, "one rank's gradient (a broadcast)"),
    (15, {"average_gradients": summed_over_the_ranks}, "divide it by world_size"),
    (16, {"attention": attention_of_unscaled_scores}, "divide the scores by sqrt(head size)"),
    (16, {"attention": attention_blind_to_the_cache}, "tril(diagonal=Tk - Tq)"),
    (16, {"Block.__init__": block_built_attention_first}, "create the modules in model.py's order"),
    (16, {"GPT.hidden_states": hidden_states_from_position_0}, "start the positions at kv_cache.length"),
    (16, {"GPT.hidden_states": hidden_states_blind_to_packed_rows}, "embed each token at its given `pos`"),
    (16, {"CausalSelfAttention.forward": attention_forward_without_its_dropout}, "the attention weights"),
    (17, {"bf16_modules": bf16_modules_with_the_layernorms}, "keeps normalisations in float32"),
    (17, {"bf16_step": bf16_step_without_the_upcast}, "upcast the logits to float32"),
    (17, {"bf16_step": bf16_step_without_autocast}, "run the forward under torch.autocast"),
    (17, {"bf16_step": bf16_step_of_a_bf16_model}, "autocast casts each matmul's inputs, never the model"),
    (17, {"bf16_step": bf16_step_of_a_model_cast_back}, "even if cast back after"),
    (18, {"byte_characters": bytes_as_themselves}, "is moved to a character of its own"),
    (18, {"pre_tokenize": split_at_spaces}, "joined together are not the text"),
    (18, {"pre_tokenize": pre_tokens_whose_spaces_stay_together}, "leaves its last whitespace character"),
    (19, {"learn_merges": merges_counting_each_word_once, "_merges_learned": merges_learned},
     "counted as often as the word occurs"),
    (19, {"learn_merges": merges_breaking_ties_the_other_way, "_merges_learned": merges_learned}, "on a tie"),
    (20, {"accumulate_with_ddp": ddp_without_no_sync, "_ddp": ddp}, "every micro-step but the last inside"),
    (20, {"accumulate_with_ddp": ddp_all_in_no_sync, "_ddp": ddp}, "no all-reduce ran"),
    (20, {"accumulate_with_ddp": ddp_divided_by_the_ranks_too, "_ddp": ddp}, "DDP already averages over the ranks"),
    (20, {"accumulate_with_ddp": ddp_all_in_no_sync_reduced_by_hand, "_ddp": ddp}, "DDP itself all-reduced nothing"),
    (20, {"accumulate_with_ddp": ddp_on_every_micro_step_counted_as_the_last, "_ddp": ddp},
     "every micro-step but the last inside"),
    (20, {"accumulate_with_ddp": ddp_on_the_last_two_micro_steps}, "need one all-reduce each, on the last micro-step"),
    (20, {"accumulate_with_ddp": ddp_reduced_by_hand_then_a_bucket_of_its_own_counted, "_ddp": ddp,
          "ddp_all_in_no_sync_reduced_by_hand": ddp_all_in_no_sync_reduced_by_hand},
     "not by DDP's backward pass"),
    (21, {"generate": generate_without_a_cache}, "feed the prompt once, then only each new token"),
    (21, {"generate": generate_past_block_size}, "> block_size"),
    (21, {"generate": generate_counted_by_the_cache_tokens_from_a_recompute,
          "_generate_without_a_cache": generate_without_a_cache}, "feed the prompt once, then only each new token"),
    (21, {"generate": generate_recomputed_with_the_count_put_back,
          "_generate_without_a_cache": generate_without_a_cache}, "feed the prompt once, then only each new token"),
    (22, {"suggest_lr": suggest_the_minimum_itself, "_suggest": suggest}, "suggest a tenth of it"),
    (22, {"suggest_lr": suggest_from_the_raw_losses}, "smooth the losses first"),
    (22, {"suggest_lr": suggest_without_stopping}, "stop reading once the smoothed loss exceeds 4 times"),
    (23, {"find_spikes": spikes_after_the_first_jump}, "each step is judged on its own"),
    (23, {"find_spikes": spikes_against_the_previous_loss}, "above the mean of the previous `window` finite"),
    (23, {"rewind_step": rewind_to_the_checkpoint_before_the_spike}, "holds step 40's update, which may have made"),
]
CODE = [  # wrong answers that are not one function
    # the answer's process patches the check's helper so that train.py's run logs no loss (issue 49, hole 3)
    (16, "import exercises.feed_capstone as _check\n_check.run_training = lambda args: []\n",
     "your run logged 0 losses where model.py's logs 6"),
    # ... or trains model.py's GPT instead of the answer's, which has no dropout on its attention weights
    (16, "import exercises.feed_capstone as _check\n_train = _check.run_training\n"
         "_check.run_training = lambda args: _train([a for a in args if 'model_module' not in a])\n"
         "_attention = attention\n"
         "attention = lambda q, k, v, allowed=None, dropout=0.0: _attention(q, k, v, allowed)\n",
     "the attention weights"),
    (21, "KVCache.length = property(lambda self: 0)  # a cache that never says how far it got\n",
     "your cache's length is 0, smaller than what sample.py's says"),
]



@pytest.mark.parametrize("number,wrong,words", WRONG, ids=ids(WRONG))
def test_a_wrong_answer_fails_in_one_sentence_that_fits_the_mistake(number, wrong, words, data_root,
                                                                    tmp_path):
    needs_task_data(number)
    failed_with(number, answer_folder(tmp_path, number, wrong), words, data_root)


@pytest.mark.parametrize("number,code,words", CODE, ids=[str(n) for n, _, _ in CODE])
def test_a_wrong_answer_of_several_lines_fails_in_one_sentence_that_fits_the_mistake(number, code, words, data_root,
                                                                                     tmp_path):
    failed_with(number, answer_folder(tmp_path, number, code=code), words, data_root)


# Answers that read the one case a fixed check used to give (issue 49, hole 4): each fails on at least 9 of 10
# gradings, and a failure names its seed, which draws the same cases, and the same sentence, again.
HARD_CODED = [
    (22, "def suggest_lr(lrs, losses):\n    return lrs[42] / 10\n", 10),
    # found by a review: the real run's step of the lowest loss, or the step before a jump (no smoothing, no rule)
    (22, "def suggest_lr(lrs, losses):\n    jump = next((i for i in range(1, 40) if losses[i] > 3 * losses[i - 1]), "
         "None)\n    return lrs[42 if jump is None else jump - 1] / 10\n", 10),
    (23, "def find_spikes(losses, threshold, window=50):\n    return list(range(41, 61))\n", 10),
    # found by a review: the rule without its window and without waiting for 10 losses
    (23, "def find_spikes(losses, threshold, window=50):\n    found, previous = [], []\n"
         "    for step, loss in enumerate(losses, 1):\n"
         "        if previous and loss > sum(previous) / len(previous) + threshold:\n            found.append(step)\n"
         "        if loss == loss:\n            previous.append(loss)\n    return found\n", 10),
    (23, "def rewind_step(spike_step, checkpoint_steps):\n    return 38\n", 10),
    # the 19 names of the one 2-layer GPT the check used to build; two depths are drawn now, so it always fails
    (17, "NAMES = sorted(bf16_modules(model.GPT(model.GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, "
         "vocab_size=512))))\ndef bf16_modules(gpt):\n    return set(NAMES)\n", 3),
]


def test_hard_coded_answers_fail_on_nine_gradings_of_ten_and_a_seed_replays_the_failure(data_root, tmp_path):
    from exercises.check import grade

    for i, (number, code, gradings) in enumerate(HARD_CODED):
        (tmp_path / str(i)).mkdir()
        folder = answer_folder(tmp_path / str(i), number, code=code)
        lines = [grade(number, folder, data_root, seed)[1] for seed in range(gradings)]
        assert sum(line.startswith(f"exercise {number} failed") for line in lines) >= 0.9 * gradings, lines
        failing = next(seed for seed, line in enumerate(lines) if "failed" in line)
        assert f"--seed={failing} draws these cases again" in lines[failing]
        assert grade(number, folder, data_root, failing)[1] == lines[failing]
