"""Where one training step's time goes on this machine, part by part, against what its cores can multiply.

    python tools/bench_step.py                                 # the quick start's shape and nanoGPT's
    python tools/bench_step.py --nanogpt=/tmp/nanoGPT --repeats=5   # and nanoGPT's own step beside ours

The limit is the machine's `torch.mm` rate: float32 2048 x 2048 matrices multiplied with the run's threads,
measured before every repeat, so each figure is a fraction of the same minute's rate. A step is cut into the
parts train.train_step runs, each timed in turn on the same model and optimizer:

  output+loss  the output layer and the loss, forward and both gradients (the fused loss, model.py)
    matmuls    its three matmuls per loss slice alone, at the same shapes: what the softmax's passes add
  blocks       the embeddings and the transformer blocks, forward and backward
    matmuls    the blocks' linear layers' matmuls alone: what attention, norms and GELU add
  optimizer    clipping, the optimizer's step and dropping the gradients
  bookkeeping  the loop around train_step (clock, metrics, plan, stopper): a real `train.py` run's step (below)
               less train_step's, timed here on the same batch shape

The last line is the most the step could reach with these matmuls at their own rates and everything else (the
softmax's passes, attention, norms, the optimizer, the loop) free: what bounds the fraction before any other work.

The whole step is that of real runs, ours (`train.train` in this process) and nanoGPT's (its train.py): a run of
11 steps and one of 11 + --steps, so that the start-up cancels (as evaluations, which are turned off). On a machine
others are using, `--threads=1` times everything by the CPU time of this process and its children, which other
processes' load barely moves; otherwise by the wall clock.

FLOPs are the model's own count (GPT.flops_per_token): the output layer's share is 6 x vocabulary x width per
token, the blocks' the rest; the optimizer and the loop are counted as none. Shapes: the quick start's
(`python train.py`, config/shakespeare.py) and nanoGPT's CPU shape (bench.py's: 4 layers, 128 wide, block 64,
12 sequences, AdamW, float32, no compile). The machine is shared in CI: `uptime` is printed beside each repeat,
and the figures are medians over the repeats.
"""

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext, redirect_stdout

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: tools/ is one folder down
sys.path.insert(0, ROOT)  # `python tools/bench_step.py` imports the project's modules

import bench  # noqa: E402 - tools/bench.py, beside this file: nanoGPT's run and its data
import train  # noqa: E402
from config import UserError, parse_args, run_command  # noqa: E402
from model import GPT, LinearCrossEntropy, choose_fast_loss, loss_slice_rows, plain_output_weight  # noqa: E402
from optimizer import build_optimizer  # noqa: E402
from devices import DEVICES  # noqa: E402
from prepare_data import ensure_dataset  # noqa: E402

NANOGPT_SHAPE = ["--model.n_layer=4", "--model.n_head=4", "--model.n_embd=128", "--model.block_size=64",
                 "--data.batch_size=12", "--train.total_batch_size=768", "--optim.name=adamw"]
SHAPES = {"quick start": [], "nanoGPT's": NANOGPT_SHAPE}
PARTS = ["output+loss", "blocks", "optimizer"]
MATMULS = ["output+loss matmuls", "blocks matmuls"]  # each part's matmuls alone: what the rest of it adds


def cpu_seconds():
    """CPU seconds of this process and of its finished children (nanoGPT's runs)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def mm_rate(clock, repeats=7):
    """FLOP/s of torch.mm on float32 2048 x 2048 matrices with the current threads, median of `repeats`."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b  # (warm-up)
    times = []
    for _ in range(repeats):
        start = clock()
        a @ b
        times.append(clock() - start)
    return 2 * 2048**3 / statistics.median(times)


class FixedBatch:
    """A loader that hands train_step the same random batch every time (the data's reading is not timed)."""

    def __init__(self, x, y):
        self.x, self.y, self.device = x, y, x.device

    def next_batch(self):
        return self.x, self.y


class Step:
    """One shape's model, optimizer and batch, built as train.py builds them from the same settings."""

    def __init__(self, cfg, clock):
        torch.manual_seed(cfg.train.seed)
        self.cfg, self.clock = cfg, clock
        self.model = GPT(cfg.model, "chunked")
        self.optimizer = build_optimizer(self.model, cfg.optim, DEVICES["cpu"].fused_optimizer)
        c = cfg.model
        self.x = torch.randint(0, c.vocab_size, (cfg.data.batch_size, c.block_size))
        self.y = torch.randint(0, c.vocab_size, (cfg.data.batch_size, c.block_size))
        # the loss's path as train.py decides it on its first micro-batch (the fused loss here), so that
        # train_step below computes what a run's step does
        why = choose_fast_loss(self.model, self.x, self.y)
        if self.model.fast_loss != "fused":  # (the parts below time the fused loss)
            raise UserError(f"this shape's step does not take the fused loss ({why}); time one whose does.")
        self.weight = self.model.get_parameter(plain_output_weight(self.model))
        self.tokens = self.x.numel()
        self.flops = {"output+loss": 6 * c.vocab_size * c.n_embd * self.tokens,
                      "step": self.model.flops_per_token() * self.tokens}
        self.flops["blocks"] = self.flops["step"] - self.flops["output+loss"]
        self.linears = [m.weight.detach() for m in self.model.modules()  # the blocks' (the output layer's apart)
                        if isinstance(m, torch.nn.Linear) and m.weight is not self.weight]
        self.flops["output+loss matmuls"] = self.flops["output+loss"]
        self.flops["blocks matmuls"] = sum(6 * self.tokens * w.numel() for w in self.linears)

    def parts(self):
        """{part: seconds} of one step cut at the hidden states: the same arithmetic as train_step's."""
        clock = self.clock
        seconds, start = {}, clock()
        hidden = self.model.hidden_states(self.x)
        forward_blocks = clock() - start
        start = clock()
        cut = hidden.detach().requires_grad_()
        loss = LinearCrossEntropy.apply(cut.reshape(-1, cut.size(-1)), self.weight, self.y.reshape(-1), True)
        loss.backward()
        seconds["output+loss"] = clock() - start
        start = clock()
        hidden.backward(cut.grad)
        seconds["blocks"] = forward_blocks + clock() - start
        start = clock()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip or float("inf"))
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        seconds["optimizer"] = clock() - start
        return seconds

    def matmuls(self):
        """{"output+loss matmuls": seconds, "blocks matmuls": seconds}: each part's matmuls alone, at the step's
        shapes. The output layer's three per loss slice (the logits, the gradients of the hidden states and of
        the weight, as model.py's fused loss makes them); each linear layer's three in the blocks (forward, the
        gradients of its input and its weight). What a part takes beyond them is its other work: the softmax's
        passes, attention, norms, GELU. Random values: a matmul's time does not depend on them."""
        clock, c = self.clock, self.cfg.model
        rows = loss_slice_rows("cpu", c.vocab_size)
        weight = self.weight.detach()
        hidden, logits = torch.randn(self.tokens, c.n_embd), torch.empty(min(rows, self.tokens), c.vocab_size)
        grad_weight = torch.zeros_like(weight)
        inputs = [(torch.randn(self.tokens, w.size(1)), torch.randn(self.tokens, w.size(0))) for w in self.linears]
        seconds, start = {}, clock()
        for first in range(0, self.tokens, rows):
            h = hidden[first:first + rows]
            slice_logits = logits[:h.size(0)]
            torch.mm(h, weight.t(), out=slice_logits)
            slice_logits @ weight
            grad_weight.addmm_(slice_logits.t(), h)
        seconds["output+loss matmuls"] = clock() - start
        start = clock()
        for w, (x, grad_y) in zip(self.linears, inputs):
            x @ w.t()
            grad_y @ w
            grad_y.t() @ x
        seconds["blocks matmuls"] = clock() - start
        return seconds

    def train_step(self):
        """Seconds of train.train_step itself, on the fixed batch."""
        start = self.clock()
        train.train_step(self.model, self.optimizer, FixedBatch(self.x, self.y), 1, nullcontext(),
                         self.cfg.optim.grad_clip)
        return self.clock() - start


def our_run(argv, steps, data_root, work, clock):
    """Seconds of a real `train.py` run of `steps` steps at this shape, in this process, from its start."""
    cfg = parse_args([*argv, f"--train.hard_stop={steps}", f"--data.data_root={data_root}",
                      f"--train.out_dir={tempfile.mkdtemp(dir=work)}", "--eval.interval=0",
                      "--eval.sample_interval=0", "--checkpoint.load=never", "--train.no_checkpoints=true",
                      f"--log.interval={steps}"])
    start = clock()
    with open(os.path.join(work, "loop.log"), "a") as log, redirect_stdout(log):  # its lines, out of the table
        train.train(cfg)
    return clock() - start


def nanogpt_run(steps, args, work, clock):
    """Seconds of a run of nanoGPT's train.py of `steps` steps at its CPU shape (tools/bench.py's)."""
    start = clock()
    bench.nanogpt(steps, args.nanogpt, args.data_root, work)
    return clock() - start


def per_step(run, steps):
    """Seconds per step of `run(n)`, from a run past the untimed steps and one `steps` steps longer."""
    short = bench.UNTIMED_STEPS + 1  # (bench.nanogpt reads the step times after those)
    return (run(short + steps) - run(short)) / steps


def measure(name, argv, args, work, clock):
    """Every part of one shape's step, `args.repeats` times, the mm rate before each: {part: [seconds]}."""
    cfg = parse_args(argv)
    step = Step(cfg, clock)
    times = {part: [] for part in ["mm", *PARTS, *MATMULS, "train_step", "loop", "nanogpt"]}
    our_run(argv, 1, args.data_root, work, clock)  # warm-up: what only the first run in a process does
    for repeat in range(args.repeats):
        load = bench.load_average()
        times["mm"].append(mm_rate(clock))
        for _ in range(2):  # warm-up: the first steps fill caches and the optimizer's state
            step.parts()
        samples = [step.parts() for _ in range(args.steps)]
        for part in PARTS:
            times[part].append(statistics.median(s[part] for s in samples))
        step.matmuls()  # (warm-up)
        alone = [step.matmuls() for _ in range(args.steps)]
        for part in MATMULS:
            times[part].append(statistics.median(a[part] for a in alone))
        times["train_step"].append(statistics.median(step.train_step() for _ in range(args.steps)))
        times["loop"].append(per_step(lambda n: our_run(argv, n, args.data_root, work, clock), args.steps))
        if args.nanogpt and argv == NANOGPT_SHAPE:
            times["nanogpt"].append(per_step(lambda n: nanogpt_run(n, args, work, clock), args.steps))
        print(f"{name}, repeat {repeat + 1}: load {load} -> {bench.load_average()}, torch.mm "
              f"{times['mm'][-1] / 1e9:.1f} GFLOP/s", flush=True)
    return step, times


def report(name, step, times, threads, clock):
    """The table of one shape: each part's median ms, its share of the loop's step, its FLOP rate / torch.mm's."""
    median = {part: statistics.median(values) for part, values in times.items() if values}
    rate = median["mm"]
    median["bookkeeping"] = median["loop"] - median["train_step"]
    cfg = step.cfg
    lines = [f"{name} shape: {cfg.model.n_layer} layers, {cfg.model.n_embd} wide, block {cfg.model.block_size}, "
             f"{cfg.data.batch_size} sequences, {cfg.optim.name}; {threads} threads; torch.mm {rate / 1e9:.1f} "
             f"GFLOP/s (median of {len(times['mm'])} repeats); "
             f"{'CPU time' if clock is cpu_seconds else 'wall time'}",
             f"  {'part':12} {'ms':>8} {'of step':>8} {'of mm':>7}"]
    labels = {"output+loss matmuls": "  matmuls", "blocks matmuls": "  matmuls", "loop": "whole step"}
    for part in ["output+loss", "output+loss matmuls", "blocks", "blocks matmuls", "optimizer", "bookkeeping", "loop"]:
        seconds = median[part]
        flops = step.flops.get("step" if part == "loop" else part)
        of_mm = f"{flops / seconds / rate:7.2f}" if flops else f"{'-':>7}"
        lines.append(f"  {labels.get(part, part):12} {seconds * 1000:8.1f} {seconds / median['loop']:8.2f} {of_mm}")
    matmuls = sum(median[part] for part in MATMULS)  # the step's FLOPs (attention's too) in the matmuls' time
    lines.append(f"  {'(the step at its matmuls alone, all else free:':57} {step.flops['step'] / matmuls / rate:.2f})")
    if "nanogpt" in median:
        seconds = median["nanogpt"]
        lines.append(f"  {'nanoGPT':12} {seconds * 1000:8.1f} {seconds / median['loop']:8.2f} "
                     f"{step.flops['step'] / seconds / rate:7.2f}   (ours {seconds / median['loop']:.2f}x faster)")
    return "\n".join(lines)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="repeats of every measurement; medians are shown")
    parser.add_argument("--steps", type=int, default=10, help="steps timed per part, run and repeat")
    parser.add_argument("--nanogpt", help="a clone of karpathy/nanoGPT, timed at its shape beside ours")
    parser.add_argument("--data_root", default=os.path.join(ROOT, "data"), help="where shakespeare/ is (or goes)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's threads (0: its default, as train.py runs); 1 on a machine others are using")
    parser.add_argument("--shape", action="append", metavar="ARGS",
                        help="time this shape instead, a quoted list of train.py settings (repeatable)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.threads < 0:
        raise UserError(f"--repeats={args.repeats} --steps={args.steps} --threads={args.threads} times nothing; "
                        f"give 1 or more repeats and steps, and 0 or more threads.")
    if args.nanogpt and not os.path.isfile(os.path.join(args.nanogpt, "train.py")):
        raise UserError(f"--nanogpt={args.nanogpt} is not a clone of karpathy/nanoGPT (it has no train.py); give "
                        f"the folder of `git clone https://github.com/karpathy/nanoGPT`.")
    if args.threads:  # here, and in nanoGPT's process
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    ensure_dataset(os.path.join(args.data_root, "shakespeare"))
    shapes = {f"given {i + 1}": s.split() for i, s in enumerate(args.shape)} if args.shape else SHAPES
    clock = cpu_seconds if torch.get_num_threads() == 1 else time.perf_counter
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name, shape_argv in shapes.items():
            results.append((name, *measure(name, shape_argv, args, work, clock)))
    for name, step, times in results:
        print(report(name, step, times, torch.get_num_threads(), clock))


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
