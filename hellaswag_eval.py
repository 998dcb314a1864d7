"""HellaSwag (Zellers et al. 2019): the benchmark GPT-2 reproductions are judged by.

Each example is a context and four endings; the model should find the true one most likely. Scoring
is completion style, the definition behind the published GPT-2 numbers (124M: acc 0.2859, acc_norm
0.2955; XL: 0.3842 / 0.4893 on the 10,042 validation examples): for each ending, the cross-entropy of
the tokens of " " + ending after the context. `acc` picks the lowest summed loss, `acc_norm` the lowest
mean loss per token. Only GPT-2's 50,257 real tokens take part in the softmax.

    python hellaswag_eval.py --init_from=out/gpt2 [--data=PATH] [--limit=N] [--device=cuda] [--json]
    python hellaswag_eval.py --init_from=out/gpt2 --tasks=arc_easy,piqa,mmlu [--data_dir=DIR] [--json]

The same scorer serves the downstream task suite (`--tasks`; the tasks and their prompt formats are
in tasks.py): every example is choices of (context, continuation), scored the same way, with `acc`
(summed log-likelihood), `acc_norm` (per token) and `acc_per_char` (per character). In the training
loop (`eval.hellaswag_interval`, `eval.tasks`) the examples are split across ranks and the correct
counts are all-reduced.
"""

import argparse
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass

import torch
import torch.distributed as dist

import tasks
from checkpoint import load_model
from config import UserError
from sample import KVCache
from tokenizer import GPT2_VOCAB_SIZE, get_tokenizer

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
SCORE_ROWS = 2**22 // GPT2_VOCAB_SIZE  # output-layer rows per slice: 16 MB of float32 logits, as the training loss
# Examples per batch: on an H100, 64 is 5.1x the plain one-example loop where 16 is 4.6x; on 2 CPU
# cores the two are equally fast (README, "HellaSwag and the downstream task suite").
BATCH_SIZE = 64
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nanogpt-lab", "hellaswag")


class HellaSwagError(UserError):
    """The data cannot be had; the message says where to put it."""


def load_examples(data_path="", cache_dir=DEFAULT_CACHE):
    """Examples from a local jsonl file, or from the cached download of the validation set."""
    if not data_path:
        data_path = os.path.join(cache_dir, "hellaswag_val.jsonl")
        if not os.path.exists(data_path):
            download(data_path)
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
                raise HellaSwagError(f"line {number} of {data_path} is not a HellaSwag example (JSON with ctx, "
                                     f"exactly four endings and a label 0-3); give the file from the HellaSwag repository.") from None
            examples.append(example)
    return examples


def download(path):
    from tqdm import tqdm

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.partial"
    try:
        with urllib.request.urlopen(URL, timeout=30) as response, open(tmp, "wb") as f:
            total = int(response.headers.get("Content-Length", 0)) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc="hellaswag_val.jsonl") as bar:
                for chunk in iter(lambda: response.read(1 << 16), b""):
                    f.write(chunk)
                    bar.update(len(chunk))
    except OSError as error:
        raise HellaSwagError(f"could not download HellaSwag ({error}); download {URL} yourself and put it at "
                             f"{path}, or pass --data PATH.") from None
    os.replace(tmp, path)


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


def encode(choices, label, group, block_size):
    """An Example from [(context, continuation), ...]: the pieces are tokenized apart, as GPT-2's
    published HellaSwag numbers were, so a continuation's tokens never merge with its context's."""
    enc = get_tokenizer()
    rows, starts, chars, truncated, tokens = [], [], [], False, {}
    for context, continuation in choices:
        context_tokens = tokens.setdefault(context, enc.encode(context))
        row = context_tokens + enc.encode(continuation)
        cut = max(0, len(row) - (block_size + 1))
        truncated |= cut > 0
        rows.append(row[cut:])
        starts.append(max(1, len(context_tokens) - cut))  # the first token is never a target
        chars.append(len(continuation) - continuation.startswith(" "))
    return Example(rows, starts, chars, label, group, truncated)


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
    """A (len(groups), 5) tensor of per-group counts: examples, right by acc, by acc_norm, by
    acc_per_char, and the sum of 1/choices (chance)."""
    counts = torch.zeros(len(groups), 5, dtype=torch.float64)
    index = {group: g for g, group in enumerate(groups)}
    for ex, scored in zip(examples, score_choices(model, examples, device, batch_size)):
        summed = [s for s, _ in scored]
        per_token = [s / n for s, n in scored]
        per_char = [s / max(1, c) for (s, _), c in zip(scored, ex.chars)]
        counts[index[ex.group]] += torch.tensor([1.0, best(summed) == ex.label, best(per_token) == ex.label,
                                                 best(per_char) == ex.label, 1 / len(ex.rows)], dtype=torch.float64)
    return counts


def score_examples(model, examples, device, batch_size=BATCH_SIZE):
    """(correct, correct_norm, truncated) counts over HellaSwag jsonl `examples`."""
    encoded = [encode_example(ex, model.config.block_size) for ex in examples]
    counts = count_correct(model, encoded, ["hellaswag"], device, batch_size)[0]
    return int(counts[1]), int(counts[2]), sum(ex.truncated for ex in encoded)


def evaluate(model, examples, device, batch_size=BATCH_SIZE, rank=0, world_size=1):
    """acc and acc_norm over all HellaSwag jsonl examples; with several ranks each scores every
    world_size-th one and the counts are summed across ranks."""
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    counts = torch.tensor(score_examples(model, examples[rank::world_size], device, batch_size), device=device)
    model.train(was_training)
    if world_size > 1:
        dist.all_reduce(counts)
    correct, correct_norm, truncated = counts.tolist()
    n = len(examples)
    return {"n": n, "acc": correct / n, "acc_norm": correct_norm / n, "truncated": truncated,
            "examples_per_sec": n / (time.perf_counter() - start)}


def load_tasks(names, block_size, data_dir="", limit=0):
    """{task: [Example, ...]}, the first `limit` of each (0 = all)."""
    tasks.check_names(names)
    return {name: [encode(*tasks.TASKS[name].format(doc), group, block_size)
                   for doc, group in tasks.load_docs(name, data_dir, limit)] for name in names}


def evaluate_tasks(model, task_examples, device, batch_size=BATCH_SIZE, rank=0, world_size=1):
    """{task: {n, acc, acc_norm, acc_per_char, chance}} plus "average" and "average_centered" (each task's
    primary accuracy rescaled so chance is 0 and perfect is 1). Ranks score every world_size-th example
    and the counts are summed; a task of several groups (MMLU's subjects) is the mean of its groups."""
    was_training = model.training
    model.eval()
    results = {}
    for name, examples in task_examples.items():
        groups = list(dict.fromkeys(ex.group for ex in examples))  # the same order on every rank
        counts = count_correct(model, examples[rank::world_size], groups, device, batch_size).to(device)
        if world_size > 1:
            dist.all_reduce(counts)
        per_group = (counts[:, 1:] / counts[:, :1]).mean(0).tolist()
        results[name] = {"n": int(counts[:, 0].sum()), "acc": per_group[0], "acc_norm": per_group[1],
                         "acc_per_char": per_group[2], "chance": per_group[3]}
    model.train(was_training)
    primary = [(r[tasks.TASKS[name].primary], r["chance"]) for name, r in results.items()]
    results["average"] = sum(acc for acc, _ in primary) / len(primary)
    results["average_centered"] = sum((acc - chance) / (1 - chance) for acc, chance in primary) / len(primary)
    return results


def main(argv):
    parser = argparse.ArgumentParser(description="Score a model on HellaSwag (completion style), or on a task suite.")
    parser.add_argument("--init_from", required=True, help="run folder, checkpoint, gpt2[-medium|-large|-xl] or HF folder")
    parser.add_argument("--data", default="", help="a hellaswag jsonl file (default: download and cache the val set)")
    parser.add_argument("--tasks", default="", help=f"comma-separated tasks instead of HellaSwag alone: {', '.join(tasks.TASKS)}")
    parser.add_argument("--data_dir", default="", help="a folder of the tasks' saved datasets (see tasks.py)")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples (of each task)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch_size", type=int, default=BATCH_SIZE, help="examples per forward pass")
    parser.add_argument("--json", action="store_true", help="print JSON lines instead of sentences")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.limit < 0:
        raise HellaSwagError(f"--batch_size must be at least 1 and --limit 0 or more (got {args.batch_size} and "
                             f"{args.limit}); give values in range.")
    if args.tasks:
        return main_tasks(args)
    examples = load_examples(args.data)
    model = load_model(args.init_from, args.device)
    if args.limit:
        examples = examples[: args.limit]
    result = evaluate(model, examples, args.device, args.batch_size)
    if args.json:
        print(json.dumps({"n": result["n"], "acc": result["acc"], "acc_norm": result["acc_norm"]}))
    else:
        print(f"HellaSwag on {result['n']} examples: acc {result['acc']:.4f}, acc_norm {result['acc_norm']:.4f} "
              f"({result['examples_per_sec']:.1f} examples/s; {result['truncated']} contexts cut from the left "
              f"to fit block_size)")


def main_tasks(args):
    """--tasks: one line per task, then the averages."""
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    tasks.check_names(names)  # before the model loads: a typo costs nothing
    model = load_model(args.init_from, args.device)
    task_examples = load_tasks(names, model.config.block_size, args.data_dir, args.limit)
    start = time.perf_counter()
    results = evaluate_tasks(model, task_examples, args.device, args.batch_size)
    seconds = time.perf_counter() - start
    for name in names:
        r = results[name]
        if args.json:
            print(json.dumps({"task": name, **r}))
        else:
            print(f"{name:15s} n {r['n']:6d}  acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}  "
                  f"acc_per_char {r['acc_per_char']:.4f}  (chance {r['chance']:.4f})")
    n = sum(results[name]["n"] for name in names)
    if args.json:
        print(json.dumps({"average": results["average"], "average_centered": results["average_centered"]}))
    else:
        print(f"average {results['average']:.4f}, chance-centred average {results['average_centered']:.4f} "
              f"({n} examples, {n / seconds:.1f} examples/s)")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as error:
        sys.exit(f"error: {error}")
