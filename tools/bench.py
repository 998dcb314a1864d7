"""Per-step time of the training step, ours and (optionally) nanoGPT's, side by side on one machine.

    python tools/bench.py                                  # this trainer at the classroom shape
    python tools/bench.py --nanogpt=/tmp/nanoGPT --repeats=3   # alternating with a clone of karpathy/nanoGPT

Both trainers run as a user runs them (`python train.py ...`) at the same shape: 4 layers, 128 wide,
4 heads, block 64, 12 sequences per step, biases, no dropout, float32, no torch.compile, on the
Shakespeare tokens. The figure is the median step time after the first 10 steps (ours: the
`throughput/step_time_sec` metric; nanoGPT: its `iter N: ... time X ms` lines). Runs alternate so
that a slow minute on the machine hurts both alike. nanoGPT is MIT-licensed; clone it anywhere but
into this repository.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: tools/ is one folder down
sys.path.insert(0, ROOT)  # `python tools/bench.py` imports the project's modules

from config import UserError, run_command  # noqa: E402 - after the line above
from data import ensure_dataset  # noqa: E402

SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=12)
UNTIMED_STEPS = 10  # the first steps warm up caches and allocators: their times are left out


def ours(steps, data_root, work):
    out = os.path.join(work, "ours")
    s = SHAPE
    subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--model.n_layer={s['n_layer']}",
                    f"--model.n_head={s['n_head']}", f"--model.n_embd={s['n_embd']}",
                    f"--model.block_size={s['block_size']}", f"--data.batch_size={s['batch_size']}",
                    f"--train.total_batch_size={s['batch_size'] * s['block_size']}", f"--train.hard_stop={steps}",
                    f"--data.data_root={data_root}", f"--train.out_dir={out}", "--eval.interval=0",
                    "--eval.sample_interval=0", "--checkpoint.load=never", "--checkpoint.save_overwrite=true",
                    "--train.no_checkpoints=true", f"--log.interval={steps}"],
                   check=True, capture_output=True, text=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return statistics.median(r["throughput/step_time_sec"] for r in rows if r["step"] > UNTIMED_STEPS) * 1000


def nanogpt(steps, clone, data_root, work):
    """nanoGPT's train.py, run from its clone (it reads configurator.py and data/<dataset>/ from there),
    on the same tokens written as the flat uint16 files it expects."""
    folder = os.path.join(clone, "data", "bench")
    if not os.path.exists(os.path.join(folder, "val.bin")):
        os.makedirs(folder, exist_ok=True)
        for split in ("train", "val"):
            shards = sorted(f for f in os.listdir(os.path.join(data_root, "shakespeare")) if f.startswith(split))
            np.concatenate([np.load(os.path.join(data_root, "shakespeare", f)) for f in shards]).astype(
                np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    s = SHAPE
    result = subprocess.run([sys.executable, os.path.join(clone, "train.py"), "--dataset=bench", "--device=cpu",
                             "--compile=False", "--dtype=float32", "--bias=True", "--dropout=0.0",
                             f"--n_layer={s['n_layer']}", f"--n_head={s['n_head']}", f"--n_embd={s['n_embd']}",
                             f"--block_size={s['block_size']}", f"--batch_size={s['batch_size']}",
                             "--gradient_accumulation_steps=1", f"--max_iters={steps}", "--eval_interval=100000",
                             "--eval_iters=1", "--log_interval=1", f"--out_dir={os.path.join(work, 'nanogpt_out')}"],
                            cwd=clone, check=True, capture_output=True, text=True)
    times = [float(t) for i, t in re.findall(r"iter (\d+): loss [\d.]+, time ([\d.]+)ms", result.stdout)
             if int(i) > UNTIMED_STEPS]
    return statistics.median(times)


def check_args(args):
    """Argument mistakes, each as one sentence, before any data is written or a trainer runs."""
    if args.steps <= UNTIMED_STEPS:
        raise UserError(f"--steps={args.steps} leaves no step to time (the first {UNTIMED_STEPS} are not timed); "
                        f"give --steps={UNTIMED_STEPS + 1} or more.")
    if args.repeats < 1:
        raise UserError(f"--repeats={args.repeats} runs nothing; give --repeats=1 or more.")
    # nanogpt() writes its data under the clone: a mistyped path must not become a new folder.
    if args.nanogpt and not os.path.isfile(os.path.join(args.nanogpt, "train.py")):
        raise UserError(f"--nanogpt={args.nanogpt} is not a clone of karpathy/nanoGPT (it has no train.py); give "
                        f"the folder of `git clone https://github.com/karpathy/nanoGPT`.")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60,
                        help=f"steps per run (the first {UNTIMED_STEPS} are not timed)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each trainer, alternating")
    parser.add_argument("--nanogpt", help="a clone of karpathy/nanoGPT to time side by side")
    parser.add_argument("--data_root", default=os.path.join(ROOT, "data"), help="where shakespeare/ is (or goes)")
    args = parser.parse_args(argv)
    check_args(args)
    ensure_dataset(os.path.join(args.data_root, "shakespeare"))
    results = {"ours": [], "nanogpt": []}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.repeats):
            results["ours"].append(ours(args.steps, args.data_root, work))
            if args.nanogpt:
                results["nanogpt"].append(nanogpt(args.steps, args.nanogpt, args.data_root, work))
    shape = ", ".join(f"{k} {v}" for k, v in SHAPE.items())
    print(f"shape: {shape}; median ms/step of each run, after step {UNTIMED_STEPS}")
    for name, values in results.items():
        if values:
            print(f"{name:8} {' '.join(f'{v:.1f}' for v in values)}  -> median {statistics.median(values):.1f} ms")
    if results["nanogpt"]:
        print(f"nanoGPT / ours = {statistics.median(results['nanogpt']) / statistics.median(results['ours']):.2f}x")


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
