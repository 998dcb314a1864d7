"""Per-step time of the training step, ours and (optionally) nanoGPT's, side by side on one machine; and the
wall time a run takes to reach a validation loss.

    python tools/bench.py                                  # this trainer at the classroom shape
    python tools/bench.py --nanogpt=/tmp/nanoGPT --repeats=3   # alternating with a clone of karpathy/nanoGPT
    python tools/bench.py --to_val_loss=5.5 --repeats=3 -- "" "--optim.schedule=wsd"   # time to val <= 5.5

Both trainers run as a user runs them (`python train.py ...`) at the same shape: 4 layers, 128 wide,
4 heads, block 64, 12 sequences per step, biases, no dropout, float32, no torch.compile, on the
Shakespeare tokens. The figure is the median step time after the first 10 steps (ours: the
`throughput/step_time_sec` metric; nanoGPT: its `iter N: ... time X ms` lines). Runs alternate so
that a slow minute on the machine hurts both alike. nanoGPT is MIT-licensed; clone it anywhere but
into this repository.

`--to_val_loss=X` times whole runs instead: each RUN is one quoted argument, a trainer's command line after
`python` (`""` is `python train.py`, the default run; `"config/shakespeare_char.py --model.n_layer=2"`; a first
word ending in train.py runs another trainer: a checkout of an older commit, or nanoGPT's train.py and its
flags). The RUNs are started in turn, repeat after repeat, so that a busy minute hurts them alike. Each is
timed from the moment its process starts, import and data preparation included, to the first evaluation
whose val loss is at most X; then it is ended. Evaluations are counted in that time, as a user waits for
them: `--eval_interval` sets how often (0 keeps the run's own cadence). `--finish` lets each run exit by
itself, and reports the time to exit and the last val loss too (the default run's figure: `python train.py`
to exit). `--fresh_data` prepares the data anew in every run, as a first run does. Put `--` before the RUNs (a
RUN may begin with `--`). With `--nanogpt=CLONE`, the Shakespeare tokens and characters are first written into
the clone as its datasets `bench` and `bench_char`.

On a machine that others are using, `--together` starts a repeat's RUNs at the same moment, each with one thread
(OMP_NUM_THREADS=1): they then share the same busy minutes, where runs in turn would each meet a different load.
One thread, because a run's two OpenMP threads wait on each other whenever another process holds a core: on
2 cores at load 6, the default step took several times longer with two threads (docs/measurements.md).
"""

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: tools/ is one folder down
sys.path.insert(0, ROOT)  # `python tools/bench.py` imports the project's modules

from config import UserError, run_command  # noqa: E402 - after the line above
from prepare_data import ensure_dataset  # noqa: E402

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
                    "--train.no_checkpoints=true", f"--log.interval={steps}",
                    "--optim.name=adamw"],  # nanoGPT's optimizer: the step against the step
                   check=True, capture_output=True, text=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return statistics.median(r["throughput/step_time_sec"] for r in rows if r["step"] > UNTIMED_STEPS) * 1000


def nanogpt_data(clone, data_root, dataset="shakespeare", name="bench"):
    """Our prepared `dataset` written into the clone as nanoGPT's data/<name>/: train.bin and val.bin (flat
    uint16 tokens, its format), and for a character dataset the meta.pkl it reads vocab_size from."""
    folder, source = os.path.join(clone, "data", name), os.path.join(data_root, dataset)
    if os.path.exists(os.path.join(folder, "val.bin")):
        return
    os.makedirs(folder, exist_ok=True)
    for split in ("train", "val"):
        shards = sorted(f for f in os.listdir(source) if f.startswith(split) and f.endswith(".npy"))
        np.concatenate([np.load(os.path.join(source, f)) for f in shards]).astype(
            np.uint16).tofile(os.path.join(folder, f"{split}.bin"))
    if os.path.exists(os.path.join(source, "meta.json")):  # nanoGPT's data/shakespeare_char/prepare.py writes these
        import pickle

        with open(os.path.join(source, "meta.json")) as f:
            vocab = json.load(f)["vocab"]
        with open(os.path.join(folder, "meta.pkl"), "wb") as f:
            pickle.dump({"vocab_size": len(vocab), "itos": dict(enumerate(vocab)),
                         "stoi": {c: i for i, c in enumerate(vocab)}}, f)


def nanogpt(steps, clone, data_root, work):
    """nanoGPT's train.py, run from its clone (it reads configurator.py and data/<dataset>/ from there),
    on the same tokens written as the flat uint16 files it expects."""
    nanogpt_data(clone, data_root)
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


# ----------------------------------------------------------------------------- time to a validation loss

# The lines that carry a val loss: ours (metrics.console_line, printed at every evaluation) and nanoGPT's.
OUR_VAL = re.compile(r"^step\s+(\d+) \|.*\| val ([\d.]+)")
NANOGPT_VAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")
OUR_CHECKPOINT = re.compile(r"^checkpoint step\d+ .*the loop stalled ([\d.]+) s")


def run_command_line(run, work, args):
    """(argv, cwd, metrics file or None) for one RUN string. Our trainer (a train.py with config.py beside it)
    gets a fresh run folder and the bench's cadence; nanoGPT's gets a fresh out_dir and is run from its clone,
    where it finds its configurator and data."""
    words = shlex.split(run)
    script = os.path.join(ROOT, "train.py")
    if words and words[0].endswith("train.py"):
        script, words = os.path.abspath(words[0]), words[1:]
    folder = os.path.dirname(script)
    out_dir = tempfile.mkdtemp(dir=work)
    if os.path.exists(os.path.join(folder, "config.py")):  # this trainer, or a checkout of it
        extra = [f"--train.out_dir={out_dir}"]
        # Console lines (and so the val loss) come out when metrics are collected: at every evaluation here.
        extra += [f"--eval.interval={args.eval_interval}",
                  f"--log.metrics_collect_interval={args.eval_interval}"] if args.eval_interval else []
        extra += [f"--train.hard_stop={args.max_steps}"] if args.max_steps else []
        extra += [f"--data.data_root={tempfile.mkdtemp(dir=work)}"] if args.fresh_data else []
        return [sys.executable, script, *words, *extra], folder, os.path.join(out_dir, "metrics.jsonl")
    extra = [f"--out_dir={out_dir}"]
    extra += [f"--eval_interval={args.eval_interval}"] if args.eval_interval else []
    extra += [f"--max_iters={args.max_steps}"] if args.max_steps else []
    return [sys.executable, script, *words, *extra], folder, None


def exact_val_loss(metrics_file, step, printed):
    """The val loss of `step` from metrics.jsonl (the console prints 4 digits: 5.5004 shows as 5.5)."""
    if metrics_file and os.path.exists(metrics_file):
        with open(metrics_file) as f:
            for line in f:
                row = json.loads(line)
                if row.get("step") == step and "val/loss" in row:
                    return row["val/loss"]
    return printed


def time_to_val_loss(run, target, work, args):
    """One timed run: {val: [(step, loss, seconds)], crossed: (step, loss, seconds) or None, exit: seconds or None}.
    The clock starts just before the process does; a crossing's time is when its line is read."""
    argv, cwd, metrics_file = run_command_line(run, work, args)
    start = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": "1"} if args.together else {})}
    process = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    result, tail = {"run": run, "val": [], "crossed": None, "exit": None}, []
    for line in process.stdout:
        seconds = time.perf_counter() - start
        tail = (tail + [line])[-20:]
        saved = OUR_CHECKPOINT.match(line)
        if saved:
            result["checkpoint_stall"] = result.get("checkpoint_stall", 0.0) + float(saved.group(1))
        match = OUR_VAL.match(line) or NANOGPT_VAL.match(line)
        if not match:
            continue
        step = int(match.group(1))
        loss = exact_val_loss(metrics_file, step, float(match.group(2)))
        result["val"].append((step, loss, seconds))
        if loss <= target and result["crossed"] is None:
            result["crossed"] = (step, loss, seconds)
            if not args.finish:
                os.killpg(process.pid, signal.SIGKILL)  # the run's own group: its data workers too
                break
    returncode = process.wait()
    if result["crossed"] is None or args.finish:
        if returncode != 0:
            raise UserError(f"the run {run!r} failed (exit status {returncode}); its last lines:\n{''.join(tail)}")
        result["exit"] = time.perf_counter() - start
    result["parts"] = time_parts(metrics_file, result["exit"] or result["crossed"][2])
    return result


def time_parts(metrics_file, seconds):
    """Where a run's seconds went, from its metrics.jsonl: the training steps, and what the loop set aside
    (evaluations, samples); `rest` is the remainder: import, data preparation, building the model, checkpoints,
    exit, and the evaluation and samples after the last step (the loop records set-aside time with the step after
    it). None for a trainer without our metrics."""
    if not metrics_file or not os.path.exists(metrics_file):
        return None
    parts = {"steps": 0.0, "eval": 0.0, "sample": 0.0}
    with open(metrics_file) as f:
        for line in f:
            row = json.loads(line)
            for part, name in (("steps", "step"), ("eval", "eval"), ("sample", "sample")):
                parts[part] += row.get(f"throughput/{name}_time_sec", 0.0)
    parts["rest"] = seconds - sum(parts.values())
    return {part: round(value, 1) for part, value in parts.items()}


def to_val_loss(args):
    """Every RUN, `args.repeats` times, alternating; prints each run as it ends, then a table of medians."""
    runs = args.runs or [""]
    results = {run: [] for run in runs}
    if args.nanogpt:
        nanogpt_data(args.nanogpt, args.data_root)
        nanogpt_data(args.nanogpt, args.data_root, "shakespeare-char", "bench_char")
    with tempfile.TemporaryDirectory() as work:
        for repeat in range(args.repeats):
            if args.together:  # all RUNs at once, one thread each: the same minutes of a shared machine for all
                with ThreadPoolExecutor(len(runs)) as pool:
                    for run, result in zip(runs, pool.map(lambda run: timed(run, work, args), runs)):
                        results[run].append(result)
            else:
                for run in runs:
                    results[run].append(timed(run, work, args))
    print(report(results, args.to_val_loss))
    return results


def timed(run, work, args):
    """time_to_val_loss, with the machine's load before and after, printed as one JSON line when it ends."""
    load = load_average()
    result = time_to_val_loss(run, args.to_val_loss, work, args)
    result["load"] = f"{load} -> {load_average()}"  # the 1-minute load before and after: was it busy?
    print(json.dumps(result), flush=True)
    return result


def load_average():
    """The machine's 1-minute load average (Linux), to tell a busy run from a quiet one."""
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def report(results, target):
    """The table: each RUN's crossing times (s), their median, and its ratio to the first RUN's median."""
    lines = [f"time to val loss <= {target} (s from process start; median of the runs; ratio to the first run)"]
    first = None
    for run, repeats in results.items():
        times = [r["crossed"][2] for r in repeats if r["crossed"]]
        steps = [r["crossed"][0] for r in repeats if r["crossed"]]
        median = statistics.median(times) if len(times) == len(repeats) else None
        first = median if first is None else first
        ratio = f"{median / first:.2f}x" if median and first else "-"
        shown = " ".join(f"{t:.1f}" for t in times)
        if len(times) < len(repeats):
            shown += " (not reached)"
        line = f"{run or '(default)'!s:60} {shown:28} median {median or float('nan'):7.1f}  {ratio:6}"
        line += f" steps {' '.join(map(str, steps))}"
        exits = [r["exit"] for r in repeats if r["exit"] is not None]
        if exits:
            last = [r["val"][-1][1] for r in repeats if r["val"]]
            line += f"  exit {' '.join(f'{e:.1f}' for e in exits)} (median {statistics.median(exits):.1f})"
            line += f" last val {' '.join(f'{v:.4f}' for v in last)}"
        lines.append(line)
    return "\n".join(lines)


def check_args(args):
    """Argument mistakes, each as one sentence, before any data is written or a trainer runs."""
    if args.to_val_loss is None and (args.runs or args.finish or args.fresh_data or args.max_steps or args.together):
        raise UserError("RUNs, --finish, --fresh_data, --together and --max_steps belong to the time-to-loss mode; add "
                        "--to_val_loss=X (e.g. --to_val_loss=5.5).")
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
    parser.add_argument("--to_val_loss", type=float, help="time each RUN until its val loss is at most this")
    parser.add_argument("--max_steps", type=int, default=0, help="and stop a run at this step (0: its own end)")
    parser.add_argument("--eval_interval", type=int, default=20,
                        help="steps between evaluations in the time-to-loss mode (0: the run's own cadence)")
    parser.add_argument("--finish", action="store_true", help="let each run exit by itself; report that time too")
    parser.add_argument("--fresh_data", action="store_true", help="prepare the data anew in every run")
    parser.add_argument("--together", action="store_true",
                        help="start a repeat's RUNs at once, each on one thread (a machine others are using)")
    parser.add_argument("runs", nargs="*", metavar="RUN",
                        help='a trainer\'s command line after `python`, quoted ("" = python train.py)')
    args = parser.parse_args(argv)
    check_args(args)
    if args.to_val_loss is not None:
        to_val_loss(args)
        return
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
