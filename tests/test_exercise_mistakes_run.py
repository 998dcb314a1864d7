"""Wrong answers to the exercises of the run around it: resuming (6), a task (7), a scaling law (8),
the optimizer's split (9), tokenization (11, 18, 19), the ranks (14, 15, 20), sampling (21) and a
loss spike (23): each the kind of mistake a student makes, each failing in one sentence that fits
the mistake, naming what differs and what to do. Each is written into a copy of the answer file
(test_exercises.answer_folder) and graded as a student's would be, in a process of its own."""

import pytest
import torch  # noqa: F401 - a wrong answer's default argument

from test_exercises import answer_folder, failed_with, ids, needs_task_data

# The wrong answers are whole functions, copied into the answer file (with the imports of
# test_exercises.HEADER, and the answer file's own names: TrainState, Task, parts, KVCache,
# filter_logits, ...).


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


def tokens_for_loss_without_the_floor(law, n, loss):
    # a loss below E + A / N^alpha is never reached
    return (law["B"] / (loss - law["E"] - law["A"] / n ** law["alpha"])) ** (1 / law["beta"])


def tokens_for_loss_strictly_below(law, n, loss):  # `< 0` where `<= 0` is needed: the floor itself
    rest = loss - law["E"] - law["A"] / n ** law["alpha"]
    if rest < 0:
        return math.inf
    return (law["B"] / rest) ** (1 / law["beta"])


def optimum_without_alpha_and_beta(law, n):
    return (law["B"] * n ** law["alpha"] / law["A"]) ** (1 / law["beta"]) / n


def embeddings_to_muon_too(model, optim):
    # Muon would own the embeddings, the output layer with them
    from optimizer import param_groups as project_groups

    groups = project_groups(model, optim)
    if optim.name == "muon":
        embeddings = [model.transformer.wte.weight, model.transformer.wpe.weight]
        for name in ("decay", "no_decay"):
            groups[name] = [p for p in groups[name] if all(p is not e for e in embeddings)]
        groups["muon"] += embeddings
    return groups


def bpe_highest_rank_first(symbols, ranks):
    parts = list(symbols)
    while len(parts) > 1:
        ranked = [(ranks[pair], i) for i, pair in enumerate(zip(parts, parts[1:])) if pair in ranks]
        if not ranked:
            break
        _, i = max(ranked)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def every_rank_the_same_sequences(position, rank, world_size, batch_size):
    return list(range(position, position + batch_size))


def broadcast_rank_0s_gradient(model, world_size):
    for p in model.parameters():
        dist.broadcast(p.grad, src=0)


def summed_over_the_ranks(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def bytes_as_themselves():
    return {b: chr(b) for b in range(256)}


def split_at_spaces(text):
    return text.split(" ")


def pre_tokens_whose_spaces_stay_together(text):  # without \s+(?!\S)
    return regex.findall(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+""", text
    )


def merges_learned(words, num_merges, weighted=True, later_first=False):
    # two mistakes, each a switch
    pieces = {word: list(word) for word in words}
    made = {character: n for n, character in enumerate(sorted({c for word in words for c in word}))}
    merges = []
    for _ in range(num_merges):
        counts = collections.Counter()
        for word, count in words.items():
            for pair in zip(pieces[word], pieces[word][1:]):
                counts[pair] += count if weighted else 1
        sign = 1 if later_first else -1
        best = max(
            counts, key=lambda pair: (counts[pair], sign * made[pair[0]], sign * made[pair[1]])
        )
        merges.append(best)
        made.setdefault(best[0] + best[1], len(made) + 256)
        for word, parts in pieces.items():
            merged, i = [], 0
            while i < len(parts):
                if parts[i : i + 2] == list(best):
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


def ddp_all_in_no_sync_reduced_by_hand(model, micro_batches):
    # DDP's all-reduce skipped, then done by hand
    total = ddp(model, micro_batches, sync="never")
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return total


def ddp_on_every_micro_step_counted_as_the_last(model, micro_batches):
    # a micro-step counter bumped
    for hook in list(
        model._forward_pre_hooks.values()
    ):  # a micro-step counter, if one hangs on the model: bump it
        for _ in range(len(micro_batches) - 1):
            hook(model, ())
    return ddp(model, micro_batches, sync="always")


def ddp_reduced_by_hand_then_a_bucket_of_its_own_counted(model, micro_batches):
    # what DDP hands its hook, made by hand: one bucket of the gradients already averaged
    class Bucket:
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


def ddp_on_the_last_two_micro_steps(model, micro_batches):
    # right gradients, each bucket all-reduced twice
    total = torch.zeros(())
    for i, (x, y) in enumerate(micro_batches):
        with model.no_sync() if i < len(micro_batches) - 2 else nullcontext():
            loss = model(x, y)
            (loss / len(micro_batches)).backward()
        total += loss.detach() / len(micro_batches)
    return total


def generate_counted_by_the_cache_tokens_from_a_recompute(
    model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None
):
    import sample  # a cached generate run for the counter alone, its tokens thrown away

    sample.generate(
        model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=None
    )
    model.transformer.wte._forward_pre_hooks.clear()  # a counter hooked on wte sees no more
    return generate_without_a_cache(model, idx, max_new_tokens, temperature, top_k, generator)


def generate_recomputed_with_the_count_put_back(
    model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None
):
    # a cached generate run for the count, then a recompute whose count is taken back out
    import sample

    # the counting block's: its closure holds the count
    forward = type(model.transformer.h[0]).forward
    counted = next(
        cell.cell_contents for cell in forward.__closure__ if isinstance(cell.cell_contents, list)
    )
    sample.generate(
        model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=None
    )
    kept = list(counted)
    tokens = generate_without_a_cache(model, idx, max_new_tokens, temperature, top_k, generator)
    counted[:] = kept
    return tokens


def ddp_divided_by_the_ranks_too(model, micro_batches):
    return ddp(model, micro_batches, ranks_too=True)


def generate_without_a_cache(
    model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None
):
    for _ in range(max_new_tokens):
        logits = filter_logits(model(idx[:, -model.config.block_size :])[:, -1, :], top_k=top_k)
        if temperature == 0:
            new = logits.argmax(dim=-1, keepdim=True)
        else:
            new = torch.multinomial(
                F.softmax(logits / temperature, dim=-1), num_samples=1, generator=generator
            )
        idx = torch.cat([idx, new], dim=1)
    return idx


def generate_past_block_size(
    model, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None
):
    cache, new = KVCache(model.config.n_layer), idx
    for _ in range(max_new_tokens):
        logits = filter_logits(model(new, kv_cache=cache)[:, -1, :], top_k=top_k)
        if temperature == 0:
            new = logits.argmax(dim=-1, keepdim=True)
        else:
            new = torch.multinomial(
                F.softmax(logits / temperature, dim=-1), num_samples=1, generator=generator
            )
        idx = torch.cat([idx, new], dim=1)
    return idx


def spikes_after_the_first_jump(losses, threshold, window=50):
    jumps = [
        step
        for step in range(11, len(losses) + 1)
        if losses[step - 1] > losses[step - 2] + threshold
    ]
    return list(range(jumps[0], len(losses) + 1)) if jumps else []


def spikes_against_the_previous_loss(losses, threshold, window=50):
    return [
        step
        for step in range(2, len(losses) + 1)
        if losses[step - 1] > losses[step - 2] + threshold
    ]


def rewind_to_the_checkpoint_before_the_spike(spike_step, checkpoint_steps):
    return max(step for step in checkpoint_steps if step < spike_step)


# (exercise, {answer function, or Class.method: the wrong one; "_name": a helper it calls}, words)
WRONG = [
    (6, {"trainer_state_from_dict": from_dict_without_the_data_position}, "TrainState.data is {}"),
    (
        6,
        {"rng_state": rng_state_without_torch, "set_rng_state": set_rng_state_without_torch},
        "torch's random number generator",
    ),
    (
        6,
        {"rng_state": rng_state_of_torch_only, "set_rng_state": set_rng_state_of_torch_only},
        "Python's random generator",
    ),
    (
        7,
        {"rte": rte_without_the_space},
        "continuation of choice 0 is 'True', which differs from OLMo's RTE format from its "
        "character 0 on",
    ),
    (7, {"rte_task": rte_task_of_superglue}, "SuperGLUE"),
    (7, {"rte_task": rte_task_scored_by_acc}, "which this project calls \"acc_per_char\""),
    (8, {"tokens_for_loss": tokens_for_loss_without_the_floor}, "is never reached (math.inf)"),
    (8, {"tokens_for_loss": tokens_for_loss_strictly_below}, "raised ZeroDivisionError"),
    (
        8,
        {"tokens_per_param_at_optimum": optimum_without_alpha_and_beta},
        "tokens_per_param_at_optimum(N",
    ),
    (9, {"param_groups": embeddings_to_muon_too}, "transformer.wte.weight is in your 'muon' group"),
    (
        11,
        {"bpe_merge": bpe_highest_rank_first},
        "the lowest rank first (the merge GPT-2 learned earliest, not the most frequent",
    ),
    (14, {"rank_sequences": every_rank_the_same_sequences}, "offset them by the rank"),
    (15, {"average_gradients": broadcast_rank_0s_gradient}, "one rank's gradient (a broadcast)"),
    (15, {"average_gradients": summed_over_the_ranks}, "divide it by world_size"),
    (18, {"byte_characters": bytes_as_themselves}, "is moved to a character of its own"),
    (18, {"pre_tokenize": split_at_spaces}, "joined together are not the text"),
    (
        18,
        {"pre_tokenize": pre_tokens_whose_spaces_stay_together},
        "leaves its last whitespace character",
    ),
    (
        19,
        {"learn_merges": merges_counting_each_word_once, "_merges_learned": merges_learned},
        "counted as often as the word occurs",
    ),
    (
        19,
        {"learn_merges": merges_breaking_ties_the_other_way, "_merges_learned": merges_learned},
        "on a tie",
    ),
    (
        20,
        {"accumulate_with_ddp": ddp_without_no_sync, "_ddp": ddp},
        "every micro-step but the last inside",
    ),
    (20, {"accumulate_with_ddp": ddp_all_in_no_sync, "_ddp": ddp}, "no all-reduce ran"),
    (
        20,
        {"accumulate_with_ddp": ddp_divided_by_the_ranks_too, "_ddp": ddp},
        "DDP already averages over the ranks",
    ),
    (
        20,
        {"accumulate_with_ddp": ddp_all_in_no_sync_reduced_by_hand, "_ddp": ddp},
        "DDP itself all-reduced nothing",
    ),
    (
        20,
        {"accumulate_with_ddp": ddp_on_every_micro_step_counted_as_the_last, "_ddp": ddp},
        "every micro-step but the last inside",
    ),
    (
        20,
        {"accumulate_with_ddp": ddp_on_the_last_two_micro_steps},
        "need one all-reduce each, on the last micro-step",
    ),
    (
        20,
        {
            "accumulate_with_ddp": ddp_reduced_by_hand_then_a_bucket_of_its_own_counted,
            "_ddp": ddp,
            "ddp_all_in_no_sync_reduced_by_hand": ddp_all_in_no_sync_reduced_by_hand,
        },
        "is not the gradient that rank accumulated over its micro-steps",
    ),
    (21, {"generate": generate_without_a_cache}, "feed the prompt once, then only each new token"),
    (21, {"generate": generate_past_block_size}, "> block_size"),
    (
        21,
        {
            "generate": generate_counted_by_the_cache_tokens_from_a_recompute,
            "_generate_without_a_cache": generate_without_a_cache,
        },
        "feed the prompt once, then only each new token",
    ),
    (
        21,
        {
            "generate": generate_recomputed_with_the_count_put_back,
            "_generate_without_a_cache": generate_without_a_cache,
        },
        "feed the prompt once, then only each new token",
    ),
    (23, {"find_spikes": spikes_after_the_first_jump}, "each step is judged on its own"),
    (
        23,
        {"find_spikes": spikes_against_the_previous_loss},
        "above the mean of the previous `window` finite",
    ),
    (
        23,
        {"rewind_step": rewind_to_the_checkpoint_before_the_spike},
        "holds step 40's update, which may have made",
    ),
]


@pytest.mark.parametrize("number,wrong,words", WRONG, ids=ids(WRONG))
def test_a_wrong_answer_fails_in_one_sentence_that_fits_the_mistake(
    number, wrong, words, data_root, tmp_path
):
    needs_task_data(number)
    failed_with(number, answer_folder(tmp_path, number, wrong), words, data_root)
