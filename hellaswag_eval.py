"""The downstream-task scorer (HellaSwag, ARC, PIQA, ...; tasks.py defines them), in the loop and on
the command line.

Every example is choices of (context, continuation); the model should find the right one most likely.
Scoring is completion style, the definition behind GPT-2's published HellaSwag numbers (124M: acc 0.2859,
acc_norm 0.2955; XL: 0.3842 / 0.4893 on the 10,042 validation examples): for each choice, the
log-likelihood of the continuation's tokens after the context, over GPT-2's 50,257 real tokens.
`acc` picks the highest sum, `acc_norm` the highest mean per token, `acc_per_char` the highest sum per
character; `loss` is the right answer's loss per character (nats), the task loss that OLMo's ladder
predicts accuracy from. A context too long for the model's window is cut from the left; an example with a
continuation longer than the window cannot be scored fairly (part of an answer would go unseen while
its length still counts) and is skipped, counted in `skipped` (as lm-evaluation-harness refuses them).

    python hellaswag_eval.py --init_from=out/gpt2                                 # HellaSwag
    python hellaswag_eval.py --init_from=out/gpt2 --tasks=arc_easy,piqa,mmlu [--data_dir=DIR] [--json]
    python hellaswag_eval.py --init_from=gpt2 --data=hellaswag_val.jsonl           # HellaSwag from a jsonl file

In the training loop (`eval.tasks`, `eval.tasks_interval`) the examples are split across ranks and
the counts are all-reduced; the metrics are eval/<task>/{acc,acc_norm,acc_per_char,loss,skipped}, eval/average and
eval/average_centered.
"""

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import tasks
from checkpoint import load_model
from config import UserError, run_command
from sample import KVCache, check_device
from tokenizer import GPT2_VOCAB_SIZE, get_tokenizer

SCORE_ROWS = 2**22 // GPT2_VOCAB_SIZE  # output-layer rows per slice: 16 MB of float32 logits, as the training loss
# Examples per batch: on an H100, 64 is 5.1x the plain one-example loop where 16 is 4.6x; on 2 CPU
# cores the two are equally fast (docs/measurements.md).
BATCH_SIZE = 64


class HellaSwagError(UserError):
    """The data cannot be had; the message says where to put it."""


def load_examples(data_path):
    """HellaSwag examples ({ctx, endings, label}, as the validation set has them) from a jsonl file,
    each line checked: a file of another kind is one sentence naming its line."""
    if not os.path.exists(data_path):
        raise HellaSwagError(f"no HellaSwag file at {data_path}; give the path of a hellaswag jsonl file.")
    examples = []
    with open(data_path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
                valid = (isinstance(example["ctx"], str) and len(example["endings"]) == 4
                         and all(isinstance(e, str) for e in example["endings"]) and 0 <= int(example["label"]) < 4)
            except (ValueError, KeyError, IndexError, TypeError):
                valid = False
            if not valid:
                raise HellaSwagError(
                    f"line {number} of {data_path} is not a HellaSwag example (JSON with ctx, "
                    f"exactly four endings and a label 0-3); give the file from the HellaSwag repository."
                ) from None
            examples.append(example)
    return examples


@dataclass
class Example:
    """One example, tokenized: a row of context + continuation tokens per choice, each cut from the left
    to block_size + 1 tokens (the last token is only a target), and what the scores need."""
    rows: list  # [[token, ...], ...] one per choice
    starts: list  # index in each row of the first scored (continuation) token
    chars: list  # characters of each continuation, without the leading space (per-character accuracy)
    label: int  # index of the right choice
    group: str  # the task, or the MMLU subject (MMLU is averaged over its subjects)
    truncated: bool  # whether a context had to be cut to fit
    fits: bool  # every continuation fits in the window: scored; else skipped (see the top)


def encode(choices, label, group, block_size):
    """An Example from [(context, continuation), ...]: the pieces are tokenized apart, as GPT-2's
    published HellaSwag numbers were, so a continuation's tokens never merge with its context's."""
    enc = get_tokenizer()
    rows, starts, chars, truncated, fits, tokens = [], [], [], False, True, {}
    for context, continuation in choices:
        context_tokens, continuation_tokens = tokens.setdefault(context, enc.encode(context)), enc.encode(continuation)
        row = context_tokens + continuation_tokens
        cut = max(0, len(row) - (block_size + 1))
        truncated |= cut > 0
        fits &= len(continuation_tokens) <= block_size  # each scored token needs one token before it
        rows.append(row[cut:])
        starts.append(max(1, len(context_tokens) - cut))  # the first token is never a target
        chars.append(len(continuation) - continuation.startswith(" "))
    return Example(rows, starts, chars, label, group, truncated, fits)


def encode_example(example, block_size):
    """A HellaSwag example from the jsonl file, in the raw-context format."""
    return encode(*tasks.hellaswag(example), "hellaswag", block_size)


def shared_prefix(example):
    """How many leading tokens every row of the example shares and no scored token needs the output
    of: those are run through the model once and their keys and values reused by every choice."""
    common = len(os.path.commonprefix(example.rows))
    return max(0, min(common, *example.starts) - 1)


@torch.no_grad()
def score_choices(model, examples, device, batch_size=BATCH_SIZE):
    """For each example, per choice, (summed log-probability of the continuation, its token count).

    What makes it fast: an example's context (the prefix its choices share) runs once, and its keys
    and values serve every choice; the choices are packed one after another into a single row, each
    attending to the context and to its own earlier tokens only, with its own positions, so there is
    no padding between them; examples are batched with others of the same context length (no padding
    there either) and similar packed length; and the output layer runs only on positions whose next
    token is scored, in slices that bound its memory."""
    plan = sorted((shared_prefix(ex), sum(len(row) - 1 for row in ex.rows), i) for i, ex in enumerate(examples))
    batches, batch = [], []
    for prefix, _, i in plan:
        if batch and (len(batch) == batch_size or prefix != batch[0][0]):
            batches.append(batch)
            batch = []
        batch.append((prefix, i))
    batches += [batch] if batch else []
    results = [None] * len(examples)
    for batch in batches:
        prefix, chosen = batch[0][0], [examples[i] for _, i in batch]
        cache = None
        if prefix:
            cache = KVCache(model.config.n_layer)
            model.hidden_states(torch.tensor([ex.rows[0][:prefix] for ex in chosen], device=device), cache)
        width = max(sum(len(row) - 1 - prefix for row in ex.rows) for ex in chosen)
        inputs, positions, segments = [], [], []
        where, targets, owner = [], [], []  # scored tokens: where their prediction is, what, whose
        first_choice = [0]  # per example, the place of its first choice among the batch's choices
        for b, ex in enumerate(chosen):
            tokens, pos, seg = [], [], []
            for c, (row, start) in enumerate(zip(ex.rows, ex.starts)):
                where += [b * width + len(tokens) + j - 1 - prefix for j in range(start, len(row))]
                targets += row[start:]
                owner += [first_choice[b] + c] * (len(row) - start)
                tokens += row[prefix:-1]
                pos += range(prefix, len(row) - 1)
                seg += [c] * (len(row) - 1 - prefix)
            padding = width - len(tokens)
            inputs.append(tokens + [0] * padding)
            positions.append(pos + [0] * padding)
            segments.append(seg + [-1 - k for k in range(padding)])  # a pad sees only itself
            first_choice.append(first_choice[b] + len(ex.rows))
        segments = torch.tensor(segments, device=device)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        mask = (segments[:, :, None] == segments[:, None, :]) & causal
        mask = torch.cat([torch.ones(len(chosen), width, prefix, dtype=torch.bool, device=device), mask], dim=2)
        hidden = model.hidden_states(torch.tensor(inputs, device=device), cache,
                                     torch.tensor(positions, device=device), mask[:, None]).flatten(0, 1)
        hidden = hidden[torch.tensor(where, device=device)]
        targets = torch.tensor(targets, device=device)
        log_probs = torch.cat([
            model.lm_head(h)[:, :GPT2_VOCAB_SIZE].float().log_softmax(-1).gather(1, t[:, None]).squeeze(1)
            for h, t in zip(hidden.split(SCORE_ROWS), targets.split(SCORE_ROWS))])
        # Summed on the CPU (the sums are needed there next): deterministic, unlike index_add_ on CUDA.
        sums = torch.zeros(first_choice[-1], dtype=torch.float64)
        sums = sums.index_add_(0, torch.tensor(owner), log_probs.double().cpu()).tolist()
        for b, ((_, i), ex) in enumerate(zip(batch, chosen)):
            results[i] = [(sums[first_choice[b] + c], len(row) - start)
                          for c, (row, start) in enumerate(zip(ex.rows, ex.starts))]
    return results


def best(values):
    """Index of the largest value; the first one on a tie."""
    return max(range(len(values)), key=values.__getitem__)


def count_correct(model, examples, groups, device, batch_size=BATCH_SIZE):
    """A (len(groups), 7) tensor of per-group sums: examples scored, right by acc, by acc_norm, by
    acc_per_char, 1/choices (chance), the right answer's loss per character (the task loss of OLMo's
    ladder), and examples skipped (a continuation too long)."""
    counts = torch.zeros(len(groups), 7, dtype=torch.float64)
    index = {group: g for g, group in enumerate(groups)}
    scorable = [ex for ex in examples if ex.fits]
    for ex in examples:
        if not ex.fits:
            counts[index[ex.group], 6] += 1
    for ex, scored in zip(scorable, score_choices(model, scorable, device, batch_size)):
        summed = [s for s, _ in scored]
        per_token = [s / n for s, n in scored]
        per_char = [s / max(1, c) for (s, _), c in zip(scored, ex.chars)]
        counts[index[ex.group], :6] += torch.tensor([1.0, best(summed) == ex.label, best(per_token) == ex.label,
                                                     best(per_char) == ex.label, 1 / len(ex.rows), -per_char[ex.label]],
                                                    dtype=torch.float64)
    return counts


def load_tasks(names, block_size, data_dir="", limit=0, hellaswag_file=""):
    """{task: [Example, ...]}, the first `limit` of each (0 = all). HellaSwag's examples come from
    `hellaswag_file` (a jsonl) when one is given, like every task's otherwise (tasks.load_docs)."""
    tasks.check_names(names)
    loaded = {}
    for name in names:
        if name == "hellaswag" and hellaswag_file:
            docs = [(doc, name) for doc in load_examples(hellaswag_file)[: limit or None]]
        else:
            docs = tasks.load_docs(name, data_dir, limit)
        loaded[name] = [encode(*tasks.TASKS[name].format(doc), group, block_size) for doc, group in docs]
    return loaded


def evaluate_tasks(model, task_examples, device, batch_size=BATCH_SIZE, rank=0, world_size=1):
    """{task: {n, acc, acc_norm, acc_per_char, chance, loss, skipped}} plus "average" and "average_centered"
    (each task's primary accuracy rescaled so chance is 0 and perfect is 1). Ranks score every world_size-th example
    and the counts are summed; a task of several groups (MMLU's subjects) is the mean of its groups."""
    was_training = model.training
    model.eval()
    results = {}
    for name, examples in task_examples.items():
        groups = list(dict.fromkeys(ex.group for ex in examples))  # the same order on every rank
        counts = count_correct(model, examples[rank::world_size], groups, device, batch_size).to(device)
        if world_size > 1:
            dist.all_reduce(counts)
        scored = counts[counts[:, 0] > 0]  # a group whose every example was skipped has no accuracy
        per_group = (scored[:, 1:6] / scored[:, :1]).mean(0).tolist() if len(scored) else [float("nan")] * 5
        results[name] = {"n": int(counts[:, 0].sum()), "acc": per_group[0], "acc_norm": per_group[1],
                         "acc_per_char": per_group[2], "chance": per_group[3], "loss": per_group[4],
                         "skipped": int(counts[:, 6].sum())}
    model.train(was_training)
    primary = [(r[tasks.TASKS[name].primary], r["chance"]) for name, r in results.items()]
    results["average"] = sum(acc for acc, _ in primary) / len(primary)
    results["average_centered"] = sum((acc - chance) / (1 - chance) for acc, chance in primary) / len(primary)
    return results


def main(argv):
    parser = argparse.ArgumentParser(description="Score a model on downstream tasks (HellaSwag by default).")
    parser.add_argument(
        "--init_from", required=True, help="run folder, checkpoint, gpt2[-medium|-large|-xl] or HF folder"
    )
    parser.add_argument("--tasks", default="hellaswag", help=f"comma-separated, of: {', '.join(tasks.TASKS)}")
    parser.add_argument("--data", default="", help="HellaSwag's examples from this jsonl file instead")
    parser.add_argument("--data_dir", default="", help="a folder of the tasks' saved datasets (see tasks.py)")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples of each task")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch_size", type=int, default=BATCH_SIZE, help="examples per forward pass")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of sentences")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.limit < 0:
        raise HellaSwagError(f"--batch_size must be at least 1 and --limit 0 or more (got {args.batch_size} and "
                             f"{args.limit}); give values in range.")
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not names:
        raise tasks.TaskDataError(
            f"--tasks={args.tasks!r} names no task; give one or more of {', '.join(tasks.TASKS)}."
        )
    tasks.check_names(names)  # before the model loads: a typo costs nothing
    check_device(args.device)
    if args.data:
        load_examples(args.data)  # a missing or wrong file, before the model loads
    model = load_model(args.init_from, args.device)
    task_examples = load_tasks(names, model.config.block_size, args.data_dir, args.limit, args.data)
    start = time.perf_counter()
    results = evaluate_tasks(model, task_examples, args.device, args.batch_size)
    seconds = time.perf_counter() - start
    for name in names:
        r = results[name]
        if args.json:
            print(json.dumps({"task": name, **r}))
        else:
            print(f"{name:15s} n {r['n']:6d}  acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}  acc_per_char "
                  f"{r['acc_per_char']:.4f}  (chance {r['chance']:.4f})"
                  + (f"; {r['skipped']} skipped: a continuation longer than block_size" if r["skipped"] else ""))
    n = sum(results[name]["n"] for name in names)
    if args.json:
        print(json.dumps({"average": results["average"], "average_centered": results["average_centered"]}))
    else:
        print(f"average {results['average']:.4f}, chance-centred average {results['average_centered']:.4f} "
              f"({n} examples, {n / seconds:.1f} examples/s)")


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
