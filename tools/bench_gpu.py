"""The GPU measurement command: is `torchrun ... train.py config/gpt2.py` fast on this GPU?

    python tools/bench_gpu.py --prepare     # once, where the packages are: data, tokenizer, build-nanogpt -> .bench/
    python tools/bench_gpu.py               # on the GPU: every part below, about 8 minutes on one H100
    python tools/bench_gpu.py --parts=loss,ours --steps=20

Parts, in order (each prints its own lines; the output ends with the summary table):
  tests       `pytest tests/test_gpu.py`: the CUDA paths give the right numbers before anything is timed
  ours        train.py config/gpt2.py (GPT-2 124M, 64 x 1,024 tokens per micro-step, 524,288 per step, bf16)
              on the Shakespeare tokens, eager and compiled, for each loss path: tokens/s and MFU by the
              stopwatch below, peak memory, first step (compile) time
  muon        the compiled run again with optim.name=muon, and its tokens/s against AdamW's
  fsdp        the compiled run again with train.data_parallel=fsdp (a world of one rank, as
              `torchrun --nproc-per-node=1` starts it), and its tokens/s and peak memory against the plain run's
  nanogpt     build-nanogpt's train_gpt2.py at the same settings, eager and compiled (a temporary copy with
              its evaluation, HellaSwag and sampling switched off and its step count lowered; nothing else),
              timed by the same stopwatch
  hellaswag   HellaSwag examples/s of the scorer at batch 64 against the plain loop (bench_eval.py)
  checkpoint  how long the loop stalls for one save of the 124M model, async and sync
  loss        the output layer + cross-entropy alone at GPT-2's micro-batch (65,536 rows x 768 -> 50,304),
              forward and backward in bf16 (last, in this process): each loss path's median time, peak
              memory and error against a float32 reference (also liger-kernel's and cut-cross-entropy's fused
              kernels if importable)

One stopwatch times both trainers, whatever either prints. Each trainer runs `--steps` optimizer steps
(`--eager_steps` eager) of 524,288 tokens in a process of its own, started by `timed_command`: before the
trainer's file runs, a global optimizer-step hook counts torch.optim.AdamW's steps (both trainers step one
AdamW once per optimizer step; the Muon that optim.name=muon steps beside it is not counted). Right after
AdamW step number `--warmup` (W) and after the run's last step (S), it waits for the GPU
(torch.cuda.synchronize()) and reads time.perf_counter(). The window so runs from the end of step W to
the end of step S and holds S - W whole steps: each one's forward, backward and update, and whatever the
loop does between two updates (its logging; ours collects its metrics every step, one sync per step, as
build-nanogpt's print syncs every step). Compiling and warm-up (steps 1 to W) and whatever follows step
S are outside it. Tokens/s = (S - W) x 524,288 / those seconds, and MFU from it, computed the same way for
both; peak memory is torch.cuda.max_memory_allocated() at the last reading. Beside them, each trainer's
own median tokens/s over steps W+1 to S and its first step's time, as it prints them, labelled so.

MFU counts 6N + 12·L·d·T FLOPs per token (PaLM, appendix B; `GPT.flops_per_token`) for both trainers
against the GPU's dense bf16 peak (plan.PEAK_BF16_FLOPS). build-nanogpt is MIT-licensed; its copy
lives in ../shared/anchors/build-nanogpt (or --anchor), and runs from a temporary folder.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: tools/ is one folder down
sys.path.insert(0, ROOT)  # `python tools/bench_gpu.py` imports the project's modules
BENCH = os.path.join(ROOT, ".bench")  # what --prepare writes; git ignores it
PARTS = ("tests", "ours", "muon", "fsdp", "nanogpt", "hellaswag", "checkpoint", "loss")
# torchrun's environment for one rank: train.py then starts a process group (FSDP needs one) without torchrun
ONE_RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}
TOKENS_PER_STEP = 524288  # 2**19, config/gpt2.py's and build-nanogpt's total_batch_size (GPT-3's 125M)
TIKTOKEN_URLS = {"vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                 "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"}
table = []  # (what, figure) rows of the summary


def report(what, figure):
    table.append((what, figure))
    print(f"  {what}: {figure}", flush=True)


# ----------------------------------------------------------------------------- preparing (no GPU needed)

def prepare(anchor):
    """Everything a GPU machine without network needs: the Shakespeare shards, tiktoken's GPT-2 files in
    its cache layout (build-nanogpt calls tiktoken.get_encoding("gpt2"), which downloads them), a copy
    of build-nanogpt, and 1,000 real HellaSwag examples as jsonl."""
    from data import gpt2_tokenizer_files
    from prepare_data import ensure_dataset

    ensure_dataset(os.path.join(BENCH, "data", "shakespeare"))
    cache = os.path.join(BENCH, "tiktoken")
    os.makedirs(cache, exist_ok=True)
    files = gpt2_tokenizer_files()
    for name, url in TIKTOKEN_URLS.items():  # tiktoken names a cached file by the SHA-1 of its URL
        shutil.copy(os.path.join(files, name), os.path.join(cache, hashlib.sha1(url.encode()).hexdigest()))
    shutil.copytree(anchor, os.path.join(BENCH, "build-nanogpt"), dirs_exist_ok=True)
    import hellaswag_eval
    rows = hellaswag_eval.load_docs("hellaswag", limit=1000)
    with open(os.path.join(BENCH, "hellaswag.jsonl"), "w") as f:
        for doc, _ in rows:
            f.write(json.dumps({"ctx": doc["ctx"], "endings": doc["endings"], "label": int(doc["label"])}) + "\n")
    print(f"prepared {BENCH}")


# ----------------------------------------------------------------------------- parts

def run_tests():
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_gpu.py"], cwd=ROOT,
                            capture_output=True, text=True)
    print(result.stdout[-3000:], result.stderr[-2000:], flush=True)
    last = (result.stdout.strip().splitlines() or ["no output"])[-1]
    report("tests/test_gpu.py", f"{last} ({time.monotonic() - start:.0f} s)")


def time_cuda(fn, repeats=10, warmup=3):
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def loss_paths():
    """Forward + backward of the output layer and the loss alone, at one GPT-2 micro-batch."""
    import torch
    from torch.nn import functional as F

    from model import chunked_cross_entropy, loss_slices

    rows, width, vocab = 64 * 1024, 768, 50304
    generator = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(rows, width, device="cuda", generator=generator)
    weight = torch.randn(vocab, width, device="cuda", generator=generator) * 0.02
    targets = torch.randint(0, 50257, (rows,), device="cuda", generator=generator)

    def full(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-1)

    def chunked(h, w, t):
        return chunked_cross_entropy(lambda x: F.linear(x, w), h, t, vocab)

    candidates = {f"chunked, {loss_slices(rows, vocab, 'cuda')} slices, eager": chunked,
                  "chunked, compiled": torch.compile(chunked),
                  "full, eager": full, "full, compiled": torch.compile(full)}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        candidates["liger-kernel fused"] = lambda h, w, t: liger_fused_linear_cross_entropy(
            h.to(torch.bfloat16), w.to(torch.bfloat16), t, ignore_index=-1)
    except ImportError:
        print("  (liger-kernel not installed: skipped)")
    try:
        from cut_cross_entropy import linear_cross_entropy
        candidates["cut-cross-entropy"] = lambda h, w, t: linear_cross_entropy(
            h.to(torch.bfloat16), w.to(torch.bfloat16), t, ignore_index=-1)
    except ImportError:
        print("  (cut-cross-entropy not installed: skipped)")

    def run(fn, autocast=True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(h, w, targets)
        loss.backward()
        return loss.detach().float(), h.grad, w.grad

    reference = run(full, autocast=False)  # float32 (TF32 off by default for float32 matmuls)
    flops = 3 * 2 * rows * width * vocab
    for name, fn in candidates.items():
        try:
            result = run(fn)
            errors = [
                (torch.linalg.norm(a.float() - b) / torch.linalg.norm(b)).item() for a, b in zip(result, reference)
            ]
            del result
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = time_cuda(lambda: run(fn))
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            report(f"loss {name}", f"{ms:.1f} ms, {flops / ms / 1e9:.0f} TFLOP/s, +{peak:.1f} GiB, "
                                   f"rel. error loss {errors[0]:.1e} grad_h {errors[1]:.1e} grad_w {errors[2]:.1e}")
        except Exception as error:  # noqa: BLE001 - a candidate that fails is reported, the others still run
            report(f"loss {name}", f"failed: {type(error).__name__}: {str(error)[:200]}")


def peak_flops():
    import torch

    from devices import DEVICES
    return DEVICES["cuda"].peak_flops("cuda"), torch.cuda.get_device_name()


def flops_per_token():
    import torch

    from model import GPT, GPTConfig
    with torch.device("meta"):
        return GPT(GPTConfig()).flops_per_token()


def cold_cache_env(folder):
    """The environment for a run whose compile starts from nothing: inductor's and Triton's caches in a
    fresh folder, so the first step's time is what a user's first run pays."""
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor_cache"),
            "TRITON_CACHE_DIR": os.path.join(folder, "triton_cache")}


# ----------------------------------------------------------------------------- the stopwatch (both trainers)

def timed_command(script, args, first_step, last_step, record, tokens_per_step=TOKENS_PER_STEP):
    """The command line that runs `python script args` with the stopwatch inside its process (`run_timed`):
    it writes the seconds from the end of AdamW step `first_step` to the end of step `last_step` to the
    file `record`."""
    assert 0 < first_step < last_step, "the window needs a warm-up step before it and a step in it"
    spec = json.dumps({"first_step": first_step, "last_step": last_step, "tokens_per_step": tokens_per_step,
                       "record": record})
    start = (f"import sys; sys.path.insert(0, {ROOT!r}); from tools import bench_gpu; "
             "bench_gpu.run_timed(sys.argv[1], sys.argv[2:])")
    return [sys.executable, "-c", start, spec, script, *args]


def run_timed(spec, argv):
    """In the trainer's process: run the file argv[0] as `python argv...` would, with torch.optim.AdamW's
    steps counted by a global post-step hook. After step `first_step` and step `last_step` the hook waits
    for the GPU and reads the clock; at the last one it writes one JSON line to `record`: first_step,
    last_step, seconds, tokens ((last_step - first_step) x tokens_per_step) and peak_gib (CUDA's peak
    allocated memory; None on a CPU)."""
    import runpy

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    spec = json.loads(spec)
    first_step, last_step = spec["first_step"], spec["last_step"]
    steps, readings = 0, {}

    def after_step(optimizer, args, kwargs):
        nonlocal steps
        if not isinstance(optimizer, torch.optim.AdamW):  # optim.name=muon steps Muon, then AdamW: one step
            return
        steps += 1
        if steps not in (first_step, last_step):
            return
        cuda = torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()  # the host runs ahead of the GPU: the step ends when the GPU's work does
        readings[steps] = time.perf_counter()
        if steps == last_step:
            with open(spec["record"], "w") as f:
                f.write(json.dumps({"first_step": first_step, "last_step": last_step,
                                    "seconds": readings[last_step] - readings[first_step],
                                    "tokens": (last_step - first_step) * spec["tokens_per_step"],
                                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}) + "\n")

    register_optimizer_step_post_hook(after_step)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # where `python script` looks first (was ROOT)
    runpy.run_path(argv[0], run_name="__main__")


def read_stopwatch(record):
    """The stopwatch's reading, or None when the run ended before its last timed step."""
    if not os.path.exists(record):
        return None
    with open(record) as f:
        return json.loads(f.read())


def report_speed(name, timing, printed, first_step, wall, note=""):
    """One row, the same for both trainers: tokens/s and MFU from the stopwatch; the trainer's own median
    tokens/s over the same steps and its first step's time beside them, as it prints them."""
    tokens_per_sec = timing["tokens"] / timing["seconds"]
    peak, _ = peak_flops()
    memory = f"{timing['peak_gib']:.1f} GiB" if timing["peak_gib"] is not None else "?"
    report(name, f"{tokens_per_sec:,.0f} tok/s, MFU {flops_per_token() * tokens_per_sec / peak:.1%} (stopwatch, steps "
                 f"{timing['first_step'] + 1}-{timing['last_step']}: {timing['seconds']:.2f} s), peak {memory}; "
                 f"as the trainer prints it: " + (f"{printed:,.0f} tok/s" if printed else "? tok/s")
                 + (f", first step {first_step:.0f} s" if first_step else "") + f"{note}; wall {wall:.0f} s")
    return tokens_per_sec


def report_failure(name, result, last_step):
    """A run that failed, or ended before the stopwatch's last step: its output's end, and one row."""
    print(result.stdout[-2000:], result.stderr[-4000:], flush=True)
    report(name, f"failed (exit {result.returncode})" if result.returncode else
           f"failed (no stopwatch reading: the run ended before step {last_step})")


def ours(steps, warmup, compile_, loss_path, extra=(), label=None, env=None):
    """train.py config/gpt2.py on the Shakespeare tokens for `steps` steps, timed by the stopwatch from the
    end of step `warmup` to the end of the last; returns (tokens/s, train.py's output)."""
    name = label or f"ours, {'compiled' if compile_ == 'true' else 'eager'}, loss {loss_path}"
    with tempfile.TemporaryDirectory() as out:
        # hard_stop, not max_steps: the run stops after `steps` on config/gpt2.py's own schedule (a max_steps
        # shorter than its 715 warmup steps is refused); the LR does not change the speed.
        args = ["config/gpt2.py", "--data.dataset=shakespeare", f"--data.data_root={os.path.join(BENCH, 'data')}",
                f"--train.total_batch_size={TOKENS_PER_STEP}", f"--train.hard_stop={steps}",
                f"--train.out_dir={out}", f"--train.compile={compile_}", f"--train.loss_path={loss_path}",
                "--train.no_evals=true", "--eval.tasks=", "--eval.tasks_interval=0", "--checkpoint.load=never",
                "--log.interval=1", "--log.metrics_collect_interval=1", *extra]
        if "--train.no_checkpoints=false" not in extra:
            args.append("--train.no_checkpoints=true")
        record = os.path.join(out, "stopwatch.json")
        start = time.monotonic()
        result = subprocess.run(timed_command(os.path.join(ROOT, "train.py"), args, warmup, steps, record), cwd=ROOT,
                                capture_output=True, text=True, env={**cold_cache_env(out), **(env or {})})
        wall = time.monotonic() - start
        timing = read_stopwatch(record)
        if result.returncode or not timing:
            report_failure(name, result, steps)
            return None, result.stdout
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    printed = [r["throughput/tokens_per_sec"] for r in rows
               if warmup < r["step"] <= steps and "throughput/tokens_per_sec" in r]
    compile_time = next((r["throughput/compile_time_sec"] for r in rows if "throughput/compile_time_sec" in r), None)
    chosen = re.search(r"output layer \+ loss: ([^\n]+)", result.stdout)
    tokens_per_sec = report_speed(name, timing, statistics.median(printed) if printed else None, compile_time, wall,
                                  note=f"; loss path: {chosen.group(1) if chosen else '?'}")
    return tokens_per_sec, result.stdout


def nanogpt(steps, warmup, compile_, anchor):
    """build-nanogpt's train_gpt2.py in a temporary folder (its shards are ours: the same uint16 format) for
    `steps` steps, timed by the same stopwatch as `ours`; returns tokens/s."""
    name = f"build-nanogpt, {'compiled' if compile_ else 'eager'}"
    with tempfile.TemporaryDirectory() as work:
        source = open(os.path.join(anchor, "train_gpt2.py")).read()
        assert f"total_batch_size = {TOKENS_PER_STEP}" in source, "build-nanogpt's step is no longer 524,288 tokens"
        edits = [  # the only lines changed: length, compile switch, evaluation/HellaSwag/sampling off
            ("max_steps = 19073", f"max_steps = {steps}"),
            ("use_compile = False", f"use_compile = {compile_}"),
            ("if step % 250 == 0 or last_step:", "if False:"),
            ("if (step % 250 == 0 or last_step) and (not use_compile):", "if False:"),
            ("if ((step > 0 and step % 250 == 0) or last_step) and (not use_compile):", "if False:"),
        ]
        for old, new in edits:
            assert source.count(old) == 1, f"build-nanogpt's train_gpt2.py changed: no single {old!r}"
            source = source.replace(old, new)
        script = os.path.join(work, "train_gpt2.py")
        with open(script, "w") as f:
            f.write(source)
        shutil.copy(os.path.join(anchor, "hellaswag.py"), work)
        os.symlink(os.path.join(BENCH, "data", "shakespeare"), os.path.join(work, "edu_fineweb10B"))
        env = cold_cache_env(work)
        if os.path.isdir(os.path.join(BENCH, "tiktoken")):
            env["TIKTOKEN_CACHE_DIR"] = os.path.join(BENCH, "tiktoken")
        record = os.path.join(work, "stopwatch.json")
        start = time.monotonic()
        result = subprocess.run(timed_command(script, [], warmup, steps, record), cwd=work, capture_output=True,
                                text=True, env=env)
        wall = time.monotonic() - start
        timing = read_stopwatch(record)
    if result.returncode or not timing:
        report_failure(name, result, steps)
        return None
    # Its own print: "step 0 | ... | dt: ...ms | tok/sec: ..."; its step s (from 0) is optimizer step s + 1.
    printed = [(int(s) + 1, float(dt), float(t)) for s, dt, t in
               re.findall(r"step\s+(\d+) \| .*dt: ([\d.]+)ms \| tok/sec: ([\d.]+)", result.stdout)]
    timed = [t for step, _, t in printed if warmup < step <= steps]
    first_step = next((dt / 1000 for step, dt, _ in printed if step == 1), None)
    return report_speed(name, timing, statistics.median(timed) if timed else None, first_step, wall)


def hellaswag():
    result = subprocess.run([sys.executable, "tools/bench_eval.py", f"--data={os.path.join(BENCH, 'hellaswag.jsonl')}",
                             "--limit=1000", "--repeats=2", "--batch_sizes=64", "--device=cuda"], cwd=ROOT,
                            capture_output=True, text=True)
    print(result.stdout[-2000:], result.stderr[-2000:], flush=True)
    for name, figure in re.findall(r"^(\S.*?)\s{2,}([\d.]+ examples/s.*)$", result.stdout, re.MULTILINE):
        report(f"hellaswag, {name}", figure)


def checkpoint_stall():
    for mode in ("true", "false"):
        _, stdout = ours(3, 1, "false", "auto", ("--train.no_checkpoints=false", "--checkpoint.interval=2",
                                                 f"--checkpoint.async_save={mode}"),
                         label=f"(checkpoint run, async={mode})")
        stalls = re.findall(r"checkpoint step(\d+) .*stalled ([\d.]+) s", stdout or "")
        report(f"checkpoint stall, {'async' if mode == 'true' else 'sync'}",
               ", ".join(f"step {s}: {t} s" for s, t in stalls) or "no checkpoint line")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="write .bench/ (needs the project's packages)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--steps", type=int, default=16,
                        help="optimizer steps of each compiled training run; the stopwatch stops after the last")
    parser.add_argument("--eager_steps", type=int, default=8, help="the same for each eager training run")
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps before the stopwatch starts (compiling, warm-up): it times steps warmup+1 "
                             "to the last")
    parser.add_argument("--loss_paths", default="chunked,full", help="train.loss_path values for `ours`")
    parser.add_argument("--anchor", default=os.path.join(ROOT, "..", "shared", "anchors", "build-nanogpt"),
                        help="folder with build-nanogpt's train_gpt2.py and hellaswag.py")
    args = parser.parse_args()
    if not 0 < args.warmup < min(args.steps, args.eager_steps):
        parser.error("--warmup must be at least 1 and below --steps and --eager_steps (the stopwatch starts after "
                     "step --warmup and stops after the last step)")
    if args.prepare:
        return prepare(args.anchor)
    anchor = args.anchor if os.path.isdir(args.anchor) else os.path.join(BENCH, "build-nanogpt")
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here; run this on a GPU machine (bench.py measures the CPU).")
    parts = args.parts.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    if "tests" in parts:
        run_tests()
    results = {}
    if "ours" in parts:
        for path in args.loss_paths.split(","):
            results[f"ours compiled {path}"] = ours(args.steps, args.warmup, "true", path)[0]
        results["ours eager"] = ours(args.eager_steps, args.warmup, "false", "auto")[0]
    if "muon" in parts:  # the same run with optim.name=muon (its LR is AdamW's: RMS-matched updates)
        results["muon compiled"] = ours(args.steps, args.warmup, "true", "auto", ("--optim.name=muon",),
                                        label="ours, compiled, loss auto, Muon")[0]
        adamw = results.get("ours compiled auto") or ours(args.steps, args.warmup, "true", "auto")[0]
        if results["muon compiled"] and adamw:
            report("Muon / AdamW tokens/s, compiled", f"{results['muon compiled'] / adamw:.2f}x")
    if "fsdp" in parts:  # GPT-2 (124M) sharded over one GPU: what FSDP's hooks and collectives cost beside DDP
        results["fsdp compiled"] = ours(args.steps, args.warmup, "true", "auto", ("--train.data_parallel=fsdp",),
                                        label="ours, compiled, loss auto, FSDP (1 rank)", env=ONE_RANK)[0]
        plain = results.get("ours compiled auto") or ours(args.steps, args.warmup, "true", "auto")[0]
        if results["fsdp compiled"] and plain:
            report("FSDP / DDP tokens/s, compiled, one GPU", f"{results['fsdp compiled'] / plain:.2f}x")
    if "nanogpt" in parts:
        results["nanogpt compiled"] = nanogpt(args.steps, args.warmup, True, anchor)
        results["nanogpt eager"] = nanogpt(args.eager_steps, args.warmup, False, anchor)
    if "hellaswag" in parts:
        hellaswag()
    if "checkpoint" in parts:
        checkpoint_stall()
    if "loss" in parts:  # last: this process keeps the GPU memory it used, which the runs above need
        loss_paths()
    best_ours = max((v for k, v in results.items() if k.startswith("ours compiled") and v), default=None)
    if best_ours and results.get("nanogpt compiled"):
        report("ours / build-nanogpt, compiled", f"{best_ours / results['nanogpt compiled']:.2f}x (tokens/s by the "
                                                 f"one stopwatch, steps {args.warmup + 1}-{args.steps})")
    if results.get("ours eager") and results.get("nanogpt eager"):
        report("ours / build-nanogpt, eager", f"{results['ours eager'] / results['nanogpt eager']:.2f}x (tokens/s by "
                                              f"the one stopwatch, steps {args.warmup + 1}-{args.eager_steps})")
    width = max(len(what) for what, _ in table) if table else 0
    print("\nsummary\n" + "\n".join(f"{what:<{width}}  {figure}" for what, figure in table))


if __name__ == "__main__":
    main()
