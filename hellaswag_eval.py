"""HellaSwag (Zellers et al. 2019): the benchmark GPT-2 reproductions are judged by.

Each example is a context and four endings; the model should find the true one most likely. Scoring
is completion style, the definition behind the published GPT-2 numbers (124M: acc 0.2859, acc_norm
0.2955; XL: 0.3842 / 0.4893 on the 10,042 validation examples): for each ending, the cross-entropy of
the tokens of " " + ending after the context. `acc` picks the lowest summed loss, `acc_norm` the lowest
mean loss per token. Only GPT-2's 50,257 real tokens take part in the softmax.

    python hellaswag_eval.py --init_from=out/gpt2 [--data=PATH] [--limit=N] [--device=cuda] [--json]

In the training loop (`eval.hellaswag_interval`) the examples are split across ranks and the correct
counts are all-reduced.
"""

import argparse
import json
import os
import sys
import time
import urllib.request

import torch
import torch.distributed as dist
from torch.nn import functional as F

from checkpoint import load_model
from config import UserError
from tokenizer import GPT2_VOCAB_SIZE, get_tokenizer

URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
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


def encode_example(example, block_size):
    """Four rows of context + ending tokens, the index where each ending starts, and whether the
    context had to be cut from the left to fit block_size + 1 tokens (the last token is only a target)."""
    enc = get_tokenizer()
    context = enc.encode(example["ctx"])
    rows, starts, truncated = [], [], False
    for ending in example["endings"]:
        row = context + enc.encode(" " + ending)
        cut = max(0, len(row) - (block_size + 1))
        truncated |= cut > 0
        rows.append(row[cut:])
        starts.append(max(1, len(context) - cut))  # the first token is never a target
    return rows, starts, truncated


@torch.no_grad()
def score_examples(model, examples, device, batch_size=16):
    """(correct, correct_norm, truncated) counts over `examples`, batch_size examples per forward."""
    block_size = model.config.block_size
    correct = correct_norm = truncated = 0
    for first in range(0, len(examples), batch_size):
        encoded = [encode_example(ex, block_size) for ex in examples[first : first + batch_size]]
        rows = [row for rows, _, _ in encoded for row in rows]
        length = max(map(len, rows))
        tokens = torch.zeros(len(rows), length, dtype=torch.long)
        mask = torch.zeros(len(rows), length, dtype=torch.bool)  # the ending tokens, as targets
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
            start = encoded[i // 4][1][i % 4]
            mask[i, start : len(row)] = True
        tokens, mask = tokens.to(device), mask.to(device)
        # Right padding is harmless: causal attention never lets a real token see a pad after it.
        logits, _ = model(tokens[:, :-1])
        logits = logits[..., :GPT2_VOCAB_SIZE].float()
        losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        target_mask = mask[:, 1:]
        summed = (losses * target_mask).sum(1).view(-1, 4)
        mean = summed / target_mask.sum(1).view(-1, 4)
        labels = torch.tensor([int(ex["label"]) for ex in examples[first : first + batch_size]], device=device)
        correct += int((summed.argmin(1) == labels).sum())
        correct_norm += int((mean.argmin(1) == labels).sum())
        truncated += sum(t for _, _, t in encoded)
    return correct, correct_norm, truncated


def evaluate(model, examples, device, batch_size=16, rank=0, world_size=1):
    """acc and acc_norm over all examples; with several ranks each scores every world_size-th one
    and the counts are summed across ranks."""
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


def main(argv):
    parser = argparse.ArgumentParser(description="Score a model on HellaSwag (completion style).")
    parser.add_argument("--init_from", required=True, help="run folder, checkpoint, gpt2[-medium|-large|-xl] or HF folder")
    parser.add_argument("--data", default="", help="a hellaswag jsonl file (default: download and cache the val set)")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch_size", type=int, default=16, help="examples per forward pass")
    parser.add_argument("--json", action="store_true", help='print one line {"n": ..., "acc": ..., "acc_norm": ...}')
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.limit < 0:
        raise HellaSwagError(f"--batch_size must be at least 1 and --limit 0 or more (got {args.batch_size} and "
                             f"{args.limit}); give values in range.")
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


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as error:
        sys.exit(f"error: {error}")
