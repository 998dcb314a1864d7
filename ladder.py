"""The model ladder: train a series of sizes with settings derived from the size, then fit a scaling law
to the small ones and check what it predicts for the largest (OLMo-core's ModelLadder, plus the fit).

    python ladder.py dry-run     config/ladder_shakespeare.py [--size=4x32] [--json]   # the plan; touches nothing
    python ladder.py run         config/ladder_shakespeare.py --size=4x32               # one size into <dir>/4x32/
    python ladder.py run-all     config/ladder_shakespeare.py                           # every unfinished size
    python ladder.py benchmark   config/ladder_shakespeare.py --size=4x32               # 100 steps: tokens/s, MFU
    python ladder.py checkpoints config/ladder_shakespeare.py [--json]                  # planned vs saved
    python ladder.py metrics     config/ladder_shakespeare.py [--csv=PATH]              # sizes x checkpoints
    python ladder.py fit         config/ladder_shakespeare.py                           # L(N, D), held-out check

A ladder config file sets the `ladder` section and any training field every run shares (data, block
size, evaluation, logging), with the same syntax and `--section.field=value` overrides as train.py.
What the ladder derives from the size (shape, batch, LR, schedule, length, checkpoints) comes from
configurator/model.py and configurator/run.py; setting one of those fields in the file is an error.
Each size is an ordinary run: its config.json reproduces it with `python train.py <dir>/<size>/config.json`,
and it resumes, lists (`checkpoint.py list`) and plots (`metrics.py plot`) like any other.
"""

import argparse
import copy
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

import tasks
from checkpoint import is_complete_checkpoint
from run_dir import changed_fields
from config import Config, ConfigError, UserError, config_to_dict, get, parse_args, run_command, sections, validate
import scaling_law
from configurator.model import (PARAMS, configure_minimal_device_mesh_spec, configure_rank_microbatch_size,
                                model_config, param_counts, shape_of)
from configurator.run import period_multiples, plan_batch, plan_run, target_batch_tokens


@dataclass(slots=True)
class LadderSettings:
    name: str = "ladder"  # names the runs (<name>-<size>) and their W&B group
    dir: str = "out/ladder"  # each size trains into <dir>/<size>/; fit.json and fit.png are written here
    sizes: list[str] = field(default_factory=lambda: ["1x32", "2x32", "4x32", "8x32"])  # size names (configurator/model.py)
    max_devices: int = 1  # devices a run may use (torchrun --nproc-per-node)
    device: str = "cpu"  # device type, for the micro-batch: cpu, H100, H200, A100-80GB, A100-40GB, ...
    chinchilla_multiple: float = 2.0  # train each size to this many Chinchilla durations: 0.5, 1, 2, 4, ...
    tokens_per_param: float = 20.0  # one Chinchilla duration in tokens per non-embedding parameter (Hoffmann et al. 2022)
    lr_multiplier: float = 1.0  # scales the run configurator's peak learning rate
    decay_fraction: float = 0.1  # each WSD-S period ends with a linear decay over this share of it
    seed: int = 42  # train.seed of every size (OLMo-core's ladder default)
    val_tokens: int = 65536  # validation tokens per evaluation, the same first ones for every size (sets eval.val_steps)
    batch_tokens: int = 0  # one global batch for every size, in tokens; 0 = OLMo's rule from N (Porian et al. 2024)
    duration_tokens: int = 0  # the duration unit in tokens, the same for every size; 0 = one Chinchilla duration (tokens_per_param x N)
    warmup_tokens: int = 0  # warmup of every size, in tokens; 0 = N tokens (OLMo)
    fit_tasks: list[str] = field(default_factory=list)  # tasks whose accuracy `fit` predicts too (two steps: Bhagia et al. 2024); each must be in eval.tasks
    optimizer: Literal["adamw", "muon"] = "adamw"  # optim.name of every size; muon takes the same LR rule (OLMo-core's muon ladder, Liu et al. 2025)
    muon_batch_multiplier: float = 2.0  # muon: OLMo's batch rule times this (OLMo-core's muon ladder doubles it); a fixed batch_tokens stays as it is


@dataclass(slots=True)
class LadderConfig(Config):
    ladder: LadderSettings = field(default_factory=LadderSettings)


# Fields the ladder sets for every size; a ladder file that sets one would be silently overruled.
DERIVED = ["model.n_layer", "model.n_head", "model.n_embd", "data.batch_size", "train.total_batch_size",
           "train.max_steps", "train.max_duration", "train.out_dir", "train.seed", "optim.name", "optim.lr", "optim.min_lr",
           "optim.beta2", "optim.weight_decay", "optim.decay_embeddings", "optim.schedule", "optim.warmup_steps",
           "optim.warmup_fraction", "optim.decay_steps", "optim.decay_fraction", "optim.decay_shape", "optim.periods",
           "optim.period_lr_multipliers", "eval.interval", "eval.val_steps", "eval.fixed_steps", "checkpoint.fixed_steps"]


LADDER_RANGES = [  # checked with config.RANGES, in the same form
    ("ladder.max_devices", lambda v: v >= 1, "at least 1"), ("ladder.sizes", lambda v: bool(v), "not empty"),
    ("ladder.tokens_per_param", lambda v: v > 0, "greater than 0"), ("ladder.val_tokens", lambda v: v >= 1, "at least 1"),
    ("ladder.lr_multiplier", lambda v: v > 0, "greater than 0"), ("ladder.decay_fraction", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("ladder.muon_batch_multiplier", lambda v: v > 0, "greater than 0"),
    *((f"ladder.{key}", lambda v: v >= 0, "0 or more") for key in ("batch_tokens", "duration_tokens", "warmup_tokens")),
]


def read_config(path, overrides):
    """The checked LadderConfig of a ladder file plus overrides; every mistake is one sentence."""
    cfg = parse_args([path, *overrides], LadderConfig(), LADDER_RANGES)
    tasks.check_names(cfg.eval.tasks, "eval.tasks")  # as train.py does: the names tasks.py defines
    default = Config()
    for key in DERIVED:
        if get(cfg, key) != get(default, key):
            raise ConfigError(f"{path} sets {key}, which the ladder derives from the model size; remove it "
                              f"(ladder.lr_multiplier, ladder.decay_fraction and ladder.seed are the knobs).")
    L = cfg.ladder
    repeated = sorted({size for size in L.sizes if L.sizes.count(size) > 1})
    if repeated:
        raise ConfigError(f"ladder.sizes names {', '.join(repeated)} more than once; list each size once.")
    for size in L.sizes:
        shape_of(size)  # a name that is not a size is one sentence
    period_multiples(L.chinchilla_multiple)
    missing = [task for task in L.fit_tasks if task not in cfg.eval.tasks]
    if missing:
        raise ConfigError(f"ladder.fit_tasks has {', '.join(missing)}, which eval.tasks does not evaluate; add it to "
                          f"eval.tasks (the ladder evaluates them at its checkpoints).")
    return cfg


# ----------------------------------------------------------------------------- the plan of one size


@dataclass(frozen=True)
class SizePlan:
    size: str
    params: dict  # configurator.model.param_counts: non_embedding, with_output, total
    target_batch_tokens: int
    min_devices: int
    batch: object  # configurator.run.BatchPlan
    run: object  # configurator.run.RunPlan

    @property
    def non_embedding_params(self):
        return self.params["non_embedding"]


def plan_size(cfg, size):
    L, seq = cfg.ladder, cfg.model.block_size
    params = param_counts(size, seq)
    n = params["non_embedding"]
    # Muon tolerates a larger batch: OLMo-core's muon ladder doubles OLMo's target batch.
    target = L.batch_tokens or round(target_batch_tokens(n) * (L.muon_batch_multiplier if L.optimizer == "muon" else 1))
    min_world_size, min_dp_world_size = configure_minimal_device_mesh_spec(size, seq, L.device)
    batch = plan_batch(target, configure_rank_microbatch_size(size, seq, L.device), seq, min_world_size,
                       min_dp_world_size, L.max_devices, size)
    run = plan_run(n, batch.batch_tokens, chinchilla_multiple=L.chinchilla_multiple,
                   tokens_per_param=L.tokens_per_param, lr_multiplier=L.lr_multiplier, decay_fraction=L.decay_fraction,
                   duration_tokens=L.duration_tokens, warmup_tokens=L.warmup_tokens)
    return SizePlan(size, params, target, min_world_size, batch, run)


def plan_sizes(cfg, only=None):
    """Plans of the ladder's sizes (or just `only`), smallest first."""
    if only and only not in cfg.ladder.sizes:
        raise ConfigError(f"--size={only} is not in ladder.sizes ({', '.join(cfg.ladder.sizes)}); pick one of those.")
    plans = [plan_size(cfg, size) for size in ([only] if only else cfg.ladder.sizes)]
    return sorted(plans, key=lambda p: p.non_embedding_params)


def run_config(cfg, plan):
    """The ordinary training Config of one size: the shared fields of the ladder file, plus the plan."""
    run = Config()
    for name, section in sections(cfg).items():
        if name != "ladder":
            setattr(run, name, copy.deepcopy(section))
    L, shape = cfg.ladder, model_config(plan.size, cfg.model.block_size)
    run.model.n_layer, run.model.n_head, run.model.n_embd = shape.n_layer, shape.n_head, shape.n_embd
    run.data.batch_size = plan.batch.micro_batch_tokens // cfg.model.block_size
    run.train.total_batch_size, run.train.max_steps = plan.batch.batch_tokens, plan.run.max_steps
    run.train.out_dir, run.train.seed = os.path.join(L.dir, plan.size), L.seed
    o = run.optim
    o.name = L.optimizer
    o.lr, o.min_lr, o.beta2, o.weight_decay, o.decay_embeddings = plan.run.lr, 0.0, plan.run.beta2, 0.1, False
    o.schedule, o.periods, o.decay_fraction, o.decay_shape = "wsds", list(plan.run.periods), L.decay_fraction, "linear"
    o.warmup_steps = plan.run.warmup_steps
    steps = [step for _, step in plan.run.checkpoints]
    run.eval.interval, run.eval.fixed_steps, run.checkpoint.fixed_steps = 0, steps, steps  # evaluate at the named ones
    run.checkpoint.interval = 0  # and keep only those (the last is the final checkpoint)
    run.eval.val_steps = max(1, round(L.val_tokens / plan.batch.batch_tokens))  # val batches are whole global batches
    run.log.wandb_group = run.log.wandb_group or L.name
    run.log.wandb_name = run.log.wandb_name or f"{L.name}-{plan.size}"
    validate(run)
    return run


def checkpoint_rows(cfg, plan):
    """[{name, step, tokens, path, exists, metrics}] of the planned checkpoints, in step order."""
    rows = []
    for name, step in plan.run.checkpoints:
        folder = os.path.join(cfg.ladder.dir, plan.size)
        metrics_path = os.path.join(folder, f"metrics_step{step}.json")
        rows.append({"name": name, "step": step, "tokens": step * plan.batch.batch_tokens,
                     "path": os.path.join(folder, f"step{step}"),
                     "exists": is_complete_checkpoint(os.path.join(folder, f"step{step}")),
                     "metrics": metrics_path if os.path.exists(metrics_path) else None})
    return rows


# ----------------------------------------------------------------------------- commands


def dry_run(cfg, plans, as_json):
    from schedule import build_schedule, plot_schedule

    for p in plans:
        b, r = p.batch, p.run
        checkpoints = [{"name": name, "step": step, "tokens": step * b.batch_tokens} for name, step in r.checkpoints]
        if as_json:
            print(json.dumps({"size": p.size, "non_embedding_params": p.non_embedding_params,
                              "total_params": p.params["total"], "target_batch_tokens": p.target_batch_tokens,
                              "batch_tokens": b.batch_tokens, "micro_batch_tokens": b.micro_batch_tokens,
                              "min_devices": p.min_devices, "devices": b.devices, "dp_world_size": b.dp_world_size,
                              "grad_accum_steps": b.grad_accum_steps, "lr": r.lr, "beta2": r.beta2,
                              "warmup_tokens": r.warmup_steps * b.batch_tokens, "duration_tokens": r.duration_tokens,
                              "max_steps": r.max_steps, "checkpoints": checkpoints}))
            continue
        seq = cfg.model.block_size
        schedule = build_schedule(run_config(cfg, p).optim, r.max_steps)
        png = plot_schedule(schedule, os.path.join(tempfile.gettempdir(), f"{cfg.ladder.name}_{p.size}_lr.png"),
                            [(step, name) for name, step in r.checkpoints[1:]])
        print(f"size {p.size}:\n"
              f"  parameters       {p.non_embedding_params:,} non-embedding, {p.params['with_output']:,} with the "
              f"output layer, {p.params['total']:,} total\n"
              f"  batch            target {p.target_batch_tokens:,} tokens; actual {b.batch_tokens:,} tokens "
              f"= {b.batch_tokens // seq:,} sequences of {seq}\n"
              f"  micro-batch      {b.micro_batch_tokens:,} tokens ({b.micro_batch_tokens // seq} sequences) per device\n"
              f"  devices          {b.devices} of {cfg.ladder.max_devices} (at least {p.min_devices}); data-parallel "
              f"size {b.dp_world_size}; {b.grad_accum_steps} accumulation step(s)\n"
              f"  optimizer        {'Muon for the block matrices + AdamW' if cfg.ladder.optimizer == 'muon' else 'AdamW'}, "
              f"peak LR {r.lr:.3g}, beta2 {r.beta2}, weight decay 0.1 (not on embeddings)\n"
              f"  warmup           {r.warmup_steps * b.batch_tokens:,} tokens ({r.warmup_steps} steps)\n"
              f"  duration         {r.duration_tokens:,} tokens = {r.max_steps:,} steps; WSD-S periods {r.periods}\n"
              f"  checkpoints      " + ", ".join(f"{c['name']} @ {c['step']}" for c in checkpoints) + "\n"
              f"  LR schedule plot {png}")


def check_world_size(plan):
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != plan.batch.devices:
        launch = (f"torchrun --nproc-per-node={plan.batch.devices} ladder.py ..." if plan.batch.devices > 1
                  else "python ladder.py ... (one process)")
        raise ConfigError(f"size {plan.size} is planned for {plan.batch.devices} device(s) but this run has "
                          f"{world_size} process(es); launch it as {launch}.")


# Settings whose change makes a trained size another experiment (the rest, logging say, may differ).
RESULT_SECTIONS = ("model", "data", "optim", "stage2")
RESULT_KEYS = ("train.total_batch_size", "train.max_steps", "train.max_duration", "train.seed", "train.dtype",
               "train.steps_to_skip", "train.nan_policy", "eval.val_steps", "eval.fixed_steps")


def size_status(cfg, plan):
    """(status, detail) of a size's folder against its plan: "new" (never started), "partial" (started,
    not at its last step), "finished", or "different" (trained under other settings; detail names them)."""
    folder = os.path.join(cfg.ladder.dir, plan.size)
    saved_path = os.path.join(folder, "config.json")
    if not os.path.exists(saved_path):
        return "new", ""
    try:
        with open(saved_path) as f:
            saved = json.load(f)
    except ValueError:
        return "different", f"its {saved_path} is unreadable"
    wanted = config_to_dict(run_config(cfg, plan))
    differences = [f"{key}={old!r} where the plan now says {new!r}" for key, (old, new) in
                   changed_fields(saved, wanted).items() if key.split(".")[0] in RESULT_SECTIONS or key in RESULT_KEYS]
    if differences:
        return "different", "; ".join(differences)
    finished = is_complete_checkpoint(os.path.join(folder, f"step{plan.run.max_steps}"))
    return ("finished" if finished else "partial"), ""


def refuse_different(cfg, plan, detail):
    raise UserError(f"size {plan.size} in {os.path.join(cfg.ladder.dir, plan.size)} was trained under other "
                    f"settings ({detail}); use another ladder.dir for these settings, or move that folder away to "
                    f"train the size anew.")


def run(cfg, plan):
    import train

    check_world_size(plan)  # before anything is written
    status, detail = size_status(cfg, plan)
    if status == "different":
        refuse_different(cfg, plan, detail)
    train.train(run_config(cfg, plan))


def run_child(command):
    """Run one size in its own process and return its exit status. Ctrl-C in a terminal reaches the
    child too (one process group) and the child finishes its step and saves; this process waits for that
    instead of killing it, and forwards a SIGINT/SIGTERM sent to it alone. Returns (status, signal name)."""
    child = subprocess.Popen(command)
    received = []

    def forward(signum, frame):
        received.append(signal.Signals(signum).name)
        if child.poll() is None and signum == signal.SIGTERM:
            child.send_signal(signum)  # a terminal's Ctrl-C already reached the child; a SIGTERM to us alone did not

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                return child.wait(), (received[0] if received else None)
            except KeyboardInterrupt:  # a signal arriving while wait() was being set up
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_all(cfg, plans, config_path, overrides):
    """Each unfinished size in its own process (torchrun when it needs several devices), smallest first.
    A size is skipped only when it finished under the plan's settings; one stopped early stops run-all."""
    statuses = [(p, *size_status(cfg, p)) for p in plans]
    for p, status, detail in statuses:  # refuse before training anything
        if status == "different":
            refuse_different(cfg, p, detail)
    start, todo = time.monotonic(), [p for p, status, _ in statuses if status != "finished"]
    for k, (p, status, _) in enumerate(statuses, 1):
        if status == "finished":
            print(f"size {p.size} ({k} of {len(plans)}): finished ({os.path.join(cfg.ladder.dir, p.size)}); skipped")
            continue
        launcher = [sys.executable] if p.batch.devices == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={p.batch.devices}"]
        command = launcher + [os.path.abspath(__file__), "run", config_path, *overrides, f"--size={p.size}"]
        print(f"size {p.size} ({k} of {len(plans)}, {p.run.max_steps:,} steps{ladder_eta(start, todo, p)}): "
              f"{' '.join(command[1:])}", flush=True)
        code, signal_name = run_child(command)
        status, detail = size_status(cfg, p)
        if signal_name:
            raise UserError(f"run-all was stopped by {signal_name}; size {p.size} saved a checkpoint of what it had "
                            f"trained: run run-all again to continue from there.")
        if code != 0:
            raise UserError(f"size {p.size} failed (its output is above); fix that, then run run-all again to "
                            f"continue from where it stopped.")
        if status == "different":  # its run wrote a config other than the plan: this ladder.py and train.py disagree
            refuse_different(cfg, p, detail)
        if status != "finished":
            raise UserError(f"size {p.size} stopped before its last step (a time limit, a CANCEL file or a signal; its "
                            f"output is above); run run-all again to continue from its checkpoint.")


def ladder_eta(start, todo, plan):
    """", about M min left for the whole ladder": sizes so far took this long per training token."""
    done = todo[: todo.index(plan)]
    tokens_done = sum(p.run.duration_tokens for p in done)
    if not tokens_done:
        return ""
    left = sum(p.run.duration_tokens for p in todo[todo.index(plan):])
    return f", about {(time.monotonic() - start) / tokens_done * left / 60:.0f} min left for the ladder"


def benchmark(cfg, plan):
    """OLMo's benchmarking run: 100 steps, no checkpoints, no evaluations, a profiler trace."""
    import metrics
    import train

    check_world_size(plan)
    bench = run_config(cfg, plan)
    bench.train.out_dir = os.path.join(cfg.ladder.dir, "benchmark", plan.size)
    bench.train.hard_stop, bench.train.no_checkpoints, bench.train.no_evals = "100steps", True, True
    bench.log.profile, bench.log.wandb, bench.checkpoint.load = True, False, "never"
    train.train(bench)
    if os.environ.get("RANK", "0") != "0":
        return
    rows = [r for r in metrics.read_jsonl(os.path.join(bench.train.out_dir, "metrics.jsonl")) if r["step"] > 10]

    def median(name):
        values = [r[name] for r in rows if name in r]
        return statistics.median(values) if values else None

    mfu = median("throughput/mfu")
    peak = max((v for r in rows for k, v in r.items() if k.startswith("system/") and "peak" in k), default=0.0)
    print(f"benchmark {plan.size}: {median('throughput/tokens_per_sec'):,.0f} tokens/s (median after step 10), "
          f"MFU {'%.1f%%' % (100 * mfu) if mfu is not None else 'unknown (peak FLOP/s of this device not known)'}, "
          f"peak memory {peak:.2f} GB; profiler trace in {os.path.join(bench.train.out_dir, 'profiler')}")


def read_metrics_file(path):
    """A metrics_step<N>.json a run wrote; a damaged one is one sentence naming it."""
    try:
        with open(path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
        return saved
    except (OSError, ValueError) as error:
        raise UserError(f"{path} cannot be read ({error}); evaluate that checkpoint again (e.g. `python "
                        f"hellaswag_eval.py`) or remove the file and its size's run folder to retrain it.") from None


def show_checkpoints(cfg, plans, as_json):
    for p in plans:
        for c in checkpoint_rows(cfg, p):
            if as_json:
                print(json.dumps({"size": p.size, **c}))
            else:
                mark = "✔" if c["exists"] else "✘"
                print(f"{mark} {p.size:<8} step {c['step']:>7,} ({c['tokens']:>12,} tokens) {c['name']:<20} {c['path']}"
                      + (f"\n    metrics: {c['metrics']}" if c["metrics"] else ""))


def metrics_table(cfg, plans):
    """[{size, checkpoint, step, tokens, non_embedding_params, <every metric saved at that step>}]."""
    table = []
    for p in plans:
        for c in checkpoint_rows(cfg, p):
            if c["metrics"]:
                saved = read_metrics_file(c["metrics"])
                saved.pop("step", None)
                table.append({"size": p.size, "checkpoint": c["name"], "step": c["step"], "tokens": c["tokens"],
                              "non_embedding_params": p.non_embedding_params, **saved})
    return table


def show_metrics(cfg, plans, csv_path):
    table = metrics_table(cfg, plans)
    if not table:
        raise UserError(f"no size under {cfg.ladder.dir} has saved metrics yet; train some with run or run-all.")
    columns = list(dict.fromkeys(["size", "checkpoint", "step", "tokens", "val/loss"]
                                 + [k for row in table for k in sorted(row) if k != "non_embedding_params"]))
    if csv_path:
        import csv

        try:
            with open(csv_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns + ["non_embedding_params"])
                writer.writeheader()
                writer.writerows(table)
        except OSError as error:
            raise UserError(f"cannot write --csv={csv_path} ({error.strerror or error}); give a path in a folder "
                            f"that exists and that you can write to.") from None
    shown = [c for c in columns if c in ("size", "checkpoint", "step", "tokens") or c.startswith(("val/", "eval/"))]
    cell = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in table)) for c in shown]
    print("  ".join(c.ljust(w) for c, w in zip(shown, widths)))
    for row in table:
        print("  ".join(cell(row.get(c, "")).ljust(w) for c, w in zip(shown, widths)))
    if csv_path:
        print(f"all {len(columns)} columns written to {csv_path}")


# ----------------------------------------------------------------------------- the scaling-law fit


def size_points(cfg, plan, metric="val/loss", names=("post-decay",)):
    """[(tokens, value, step)] of `metric` at the size's checkpoints whose name ends with one of `names`
    (all checkpoints for names=("",)); None when a checkpoint lacks its metrics. A value that cannot be a
    loss (NaN, Inf, 0 or less) is refused, naming the size and the step."""
    status, detail = size_status(cfg, plan)
    if status == "different":
        refuse_different(cfg, plan, detail)
    points = []
    for c in checkpoint_rows(cfg, plan):
        if not c["name"].endswith(names) or c["step"] == 0 and names != ("",):
            continue
        value = read_metrics_file(c["metrics"]).get(metric) if c["metrics"] else None
        if value is None:
            return None
        points.append((c["tokens"], value, c["step"]))
    return points


def check_losses(size, points, metric):
    for tokens, value, step in points:
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"size {size} has {metric}={value} at step {step}, which no scaling law can fit; retrain "
                            f"that size from an earlier checkpoint (checkpoint.resume_step) or drop it from ladder.sizes.")


def finished_sizes(cfg, plans, metric="val/loss"):
    """[(plan, [(tokens, value, step)])] of the sizes whose post-decay checkpoints all have `metric`; a
    sentence saying what is missing when fewer than three do (two to fit, the largest to check)."""
    finished, missing = [], []
    for p in plans:
        points = size_points(cfg, p, metric)
        if points is None:
            missing.append(f"{p.size} (no {metric} at some post-decay checkpoint)")
            continue
        check_losses(p.size, points, metric)
        finished.append((p, points))
    if len(finished) < 3:
        raise UserError(f"the fit needs three finished sizes (two to fit, the largest to check), and "
                        f"{len(finished)} are finished; missing: {'; '.join(missing)}. Train them with run-all.")
    return finished


def fit_sizes(finished, params="non_embedding", rounds=0):
    """The law fitted to `finished` sizes' points with N counted as `params`; with `rounds`, also its
    bootstrap refits. A fit that did not converge is one sentence."""
    points = [(p.params[params], d, loss) for p, pts in finished for d, loss, _ in pts]
    law = scaling_law.fit_law(points)
    if not law["converged"]:
        raise UserError(f"the scaling-law fit did not converge ({law['message']}); check the losses with "
                        f"`python ladder.py metrics`, or add sizes.")
    return law, (scaling_law.bootstrap(points, law, rounds) if rounds else [])


def fit(cfg, plans, params="non_embedding", task=None, rounds=200):
    finished = finished_sizes(cfg, plans)
    held_out, fitted = finished[-1], finished[:-1]
    law, refits = fit_sizes(fitted, params, rounds)
    n_held = held_out[0].params[params]
    bands = {name: scaling_law.interval([r[name] for r in refits]) for name in ("E", "A", "alpha", "B", "beta")}
    ratio = scaling_law.optimal_tokens_per_param(law, n_held)
    ratio_band = scaling_law.interval([scaling_law.optimal_tokens_per_param(r, n_held) for r in refits])
    holdout = []
    for d, loss, step in held_out[1]:
        predicted = scaling_law.predict(law, n_held, d)
        holdout.append({"size": held_out[0].size, "step": step, "tokens": d, "predicted": predicted,
                        "interval": scaling_law.interval([scaling_law.predict(r, n_held, d) for r in refits]),
                        "measured": loss, "relative_error": (predicted - loss) / loss})
    choices = {}  # the held-out error with each way of counting N (README: which predicts best)
    for choice in PARAMS:
        other = law if choice == params else fit_sizes(fitted, choice)[0]
        choices[choice] = max(abs(scaling_law.predict(other, held_out[0].params[choice], d) - loss) / loss
                              for d, loss, _ in held_out[1])
    result = {"params": {k: law[k] for k in ("E", "A", "alpha", "B", "beta")}, "intervals": bands,
              "n_counts": params, "bootstrap_rounds": len(refits), "holdout": holdout,
              "fitted_sizes": [p.size for p, _ in fitted], "optimal_tokens_per_param": ratio,
              "optimal_tokens_per_param_interval": ratio_band, "max_holdout_error_by_params": choices,
              "points": [{"size": p.size, "N": p.params[params], "tokens": d, "loss": loss, "step": step}
                         for p, pts in finished for d, loss, step in pts]}
    tasks_fitted = [task] if task else cfg.ladder.fit_tasks
    result["tasks"] = {name: fit_task(cfg, finished, name, params) for name in tasks_fitted}
    os.makedirs(cfg.ladder.dir, exist_ok=True)
    with open(os.path.join(cfg.ladder.dir, "fit.json"), "w") as f:
        json.dump(result, f, indent=1)
    png = scaling_law.plot_fit(finished, law, refits, params, os.path.join(cfg.ladder.dir, "fit.png"))
    print(describe_fit(result, held_out[0], n_held))
    for name, task_fit in result["tasks"].items():
        print(describe_task(name, task_fit))
    print(f"wrote {os.path.join(cfg.ladder.dir, 'fit.json')} and {png}")


def describe_fit(result, held_out, n_held):
    p, bands = result["params"], result["intervals"]

    def with_band(name, fmt):
        low, high = bands[name]
        return f"{name} = {format(p[name], fmt)} [{format(low, fmt)}, {format(high, fmt)}]"

    lines = [f"fit on {', '.join(result['fitted_sizes'])} ({len(result['points']) - len(result['holdout'])} post-decay "
             f"points), N = {result['n_counts']} parameters; [90% intervals from {result['bootstrap_rounds']} "
             f"bootstrap refits]",
             f"  L(N, D) = {p['E']:.3f} + {p['A']:.4g} / N^{p['alpha']:.3f} + {p['B']:.4g} / D^{p['beta']:.3f}",
             "  " + ", ".join(with_band(name, fmt) for name, fmt in (("E", ".3f"), ("alpha", ".3f"), ("beta", ".3f"))),
             f"  compute-optimal tokens per parameter at N = {n_held:,}: {result['optimal_tokens_per_param']:.3g} "
             f"[{result['optimal_tokens_per_param_interval'][0]:.3g}, "
             f"{result['optimal_tokens_per_param_interval'][1]:.3g}]",
             f"held out, size {held_out.size}:"]
    for h in result["holdout"]:
        lines.append(f"  {h['tokens']:>12,} tokens: predicted {h['predicted']:.4f} [{h['interval'][0]:.4f}, "
                     f"{h['interval'][1]:.4f}], measured {h['measured']:.4f}, relative error "
                     f"{100 * h['relative_error']:+.2f}%")
    lines.append("largest held-out error by what N counts: " + ", ".join(
        f"{choice} {100 * error:.2f}%" for choice, error in result["max_holdout_error_by_params"].items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- downstream tasks: two steps


def fit_task(cfg, finished, task, params):
    """OLMo's two-step prediction of a task's accuracy at the held-out size: step one, the law fitted to
    the task loss (eval/<task>/loss: the correct answer's loss per character) of the fitted sizes'
    post-decay checkpoints; step two, a sigmoid from task loss to accuracy fitted on every evaluated
    checkpoint of those sizes; chained at the held-out size's post-decay checkpoints."""
    metric, accuracy = f"eval/{task}/loss", f"eval/{task}/{tasks.TASKS[task].primary}"
    held_out, fitted = finished[-1], finished[:-1]
    loss_points = []
    for p, _ in finished:
        points = size_points(cfg, p, metric)
        if points is None:
            raise UserError(f"size {p.size} has no {metric} at its post-decay checkpoints; evaluate the task there "
                            f"(eval.tasks in the ladder file) and train again, or drop --task.")
        check_losses(p.size, points, metric)
        loss_points.append(points)
    pairs = [(values[metric], values[accuracy]) for p, _ in fitted for c in checkpoint_rows(cfg, p) if c["metrics"]
             for values in [read_metrics_file(c["metrics"])] if metric in values and accuracy in values]
    step1 = scaling_law.fit_law([(p.params[params], d, loss) for (p, _), pts in zip(fitted, loss_points[:-1])
                                 for d, loss, _ in pts])
    accuracies = [a for _, a in pairs]
    flat = max(accuracies) - min(accuracies) < 0.02
    step2 = None if flat else scaling_law.fit_sigmoid(*zip(*pairs))
    n_held = held_out[0].params[params]
    predictions = []
    for (d, measured_loss, step), c in zip(loss_points[-1], [c for c in checkpoint_rows(cfg, held_out[0])
                                                             if c["name"].endswith("post-decay")]):
        predicted_loss = scaling_law.predict(step1, n_held, d)
        measured_accuracy = read_metrics_file(c["metrics"]).get(accuracy)
        predictions.append({"tokens": d, "step": step, "predicted_loss": predicted_loss, "measured_loss": measured_loss,
                            "predicted_accuracy": scaling_law.sigmoid(step2, predicted_loss) if step2 else None,
                            "measured_accuracy": measured_accuracy})
    return {"accuracy_metric": accuracy, "step1": {k: step1[k] for k in ("E", "A", "alpha", "B", "beta")},
            "step2": step2, "accuracy_spread": max(accuracies) - min(accuracies), "held_out": predictions}


def describe_task(task, result):
    lines = [f"task {task} ({result['accuracy_metric']}), two steps:"]
    if result["step2"] is None:
        lines.append(f"  its accuracy moves by {result['accuracy_spread']:.3f} across every checkpoint (chance level at "
                     f"these sizes): there is no sigmoid to fit, so only the task loss is predicted")
    for h in result["held_out"]:
        line = (f"  {h['tokens']:>12,} tokens: task loss predicted {h['predicted_loss']:.4f}, measured "
                f"{h['measured_loss']:.4f}")
        if h["predicted_accuracy"] is not None:
            line += f"; accuracy predicted {h['predicted_accuracy']:.4f}, measured {h['measured_accuracy']:.4f}"
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- two ladders compared


def compare(config_a, config_b, overrides, params="non_embedding", rounds=200):
    """`ladder.py compare A B`: how many times the compute (6ND, at the same N) ladder A needs to reach the
    loss ladder B reaches, at each size, predicted at the largest size from the smaller ones (with a
    bootstrap interval), and extrapolated to a size 4x the largest. Above 1, B's recipe is better."""
    ladders = []
    for path in (config_a, config_b):
        cfg = read_config(path, overrides)
        finished = finished_sizes(cfg, plan_sizes(cfg))
        ladders.append((cfg, finished, fit_sizes(finished, params)[0], fit_sizes(finished[:-1], params, rounds)))
    (cfg_a, sizes_a, all_a, (small_a, refits_a)), (cfg_b, sizes_b, all_b, (small_b, refits_b)) = ladders
    common = [size for size in (p.size for p, _ in sizes_b) if size in {p.size for p, _ in sizes_a}]
    if len(common) < 3:
        raise UserError(f"{config_a} and {config_b} share {len(common)} finished sizes; compare needs three or more "
                        f"(the same ladder.sizes, trained with run-all).")
    by_size_a, by_size_b = ({p.size: (p, pts) for p, pts in sizes} for sizes in (sizes_a, sizes_b))
    rows = []
    for size in common:
        (plan, points_b), (_, points_a) = by_size_b[size], by_size_a[size]
        n, (d, loss_b, _) = plan.params[params], points_b[-1]
        rows.append({"size": size, "N": n, "tokens": d, "loss_b": loss_b,
                     "measured": measured_multiplier(points_a, loss_b, all_a, n, d),
                     "through_laws": scaling_law.compute_multiplier(all_a, all_b, n, d)})
    held = rows[-1]
    pairs = list(zip(refits_a, refits_b))
    predicted = scaling_law.compute_multiplier(small_a, small_b, held["N"], held["tokens"])
    band = scaling_law.interval([scaling_law.compute_multiplier(a, b, held["N"], held["tokens"]) for a, b in pairs])
    far = 4 * held["N"]
    extrapolated = scaling_law.compute_multiplier(all_a, all_b, far, held["tokens"])
    result = {"a": config_a, "b": config_b, "params": params, "sizes": rows,
              "held_out": {"size": held["size"], "predicted": predicted, "interval": band, "measured": held["measured"],
                           # 1% of slack: the measured multiplier interpolates between A's checkpoints
                           "held": 0.99 * band[0] <= held["measured"] <= 1.01 * band[1]},
              "extrapolated": {"N": far, "tokens": held["tokens"], "multiplier": extrapolated}}
    print(f"compute multiplier: the compute A ({config_a}) needs to reach B's ({config_b}) loss, at the same N "
          f"(above 1: B is better)")
    for r in rows:
        print(f"  {r['size']:<8} N {r['N']:>11,}  {r['tokens']:>12,} tokens  B's loss {r['loss_b']:.4f}  measured "
              f"{r['measured']:.3f}x  through the laws {r['through_laws']:.3f}x")
    h = result["held_out"]
    print(f"  predicted at {h['size']} from the smaller sizes: {h['predicted']:.3f}x [{h['interval'][0]:.3f}, "
          f"{h['interval'][1]:.3f}]; measured {h['measured']:.3f}x: the prediction "
          f"{'held' if h['held'] else 'did not hold'}")
    print(f"  extrapolated to N = {far:,} at {held['tokens']:,} tokens: {extrapolated:.3f}x")
    out = os.path.join(cfg_b.ladder.dir, f"compare_{cfg_a.ladder.name}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


def measured_multiplier(points_a, loss_b, law_a, n, d):
    """D_A / d, D_A where A's own measured post-decay losses at this size reach `loss_b`: interpolated
    between them in log D, or from A's law beyond them."""
    for (d0, l0, _), (d1, l1, _) in zip(points_a, points_a[1:]):
        if l1 <= loss_b <= l0 and l0 != l1:
            return math.exp(math.log(d0) + (math.log(d1) - math.log(d0)) * (l0 - loss_b) / (l0 - l1)) / d
    return scaling_law.tokens_to_reach(law_a, n, loss_b) / d


# ----------------------------------------------------------------------------- the command line

COMMANDS = ("dry-run", "run", "run-all", "benchmark", "checkpoints", "metrics", "fit", "compare")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Any other --section.field=value "
                                     "overrides the ladder file(s), as in train.py.")
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("config", nargs="+", help="a ladder config file, e.g. config/ladder_shakespeare.py "
                                                  "(compare: two of them, A then B)")
    parser.add_argument("--size", help="one size of ladder.sizes (run and benchmark need it)")
    parser.add_argument("--json", action="store_true", help="dry-run, checkpoints: JSON lines")
    parser.add_argument("--csv", help="metrics: also write every column to this CSV file")
    parser.add_argument("--params", default="non_embedding", choices=PARAMS,
                        help="fit, compare: what N counts (default: non_embedding, Kaplan et al.)")
    parser.add_argument("--task", help="fit: also predict this task's accuracy (two steps: Bhagia et al. 2024)")
    parser.add_argument("--rounds", type=int, default=200, help="fit, compare: bootstrap refits for the intervals")
    args, overrides = parser.parse_known_args(argv)
    if len(args.config) != (2 if args.command == "compare" else 1):
        raise UserError(f"{args.command} takes {'two ladder files (A, then B)' if args.command == 'compare' else 'one ladder file'}, "
                        f"and {len(args.config)} were given; e.g. python ladder.py {args.command} "
                        f"config/ladder_shakespeare.py{' config/ladder_shakespeare_muon.py' if args.command == 'compare' else ''}.")
    if args.rounds < 0:
        raise UserError(f"--rounds={args.rounds} must be 0 or more; give the number of bootstrap refits.")
    if args.command == "compare":
        return compare(*args.config, overrides, args.params, args.rounds)
    cfg = read_config(args.config[0], overrides)
    if args.task:
        tasks.check_names([args.task], "--task")
        if args.task not in cfg.eval.tasks:
            raise UserError(f"--task={args.task} is not among eval.tasks of {args.config[0]}, so the ladder has no "
                            f"scores for it; add it to eval.tasks and train the sizes.")
    if args.command in ("run", "benchmark") and not args.size:
        raise UserError(f"{args.command} trains one size; add --size=NAME, one of {', '.join(cfg.ladder.sizes)}.")
    plans = plan_sizes(cfg, args.size)
    if args.command == "dry-run":
        dry_run(cfg, plans, args.json)
    elif args.command == "run":
        run(cfg, plans[0])
    elif args.command == "run-all":
        run_all(cfg, plans, args.config[0], overrides)
    elif args.command == "benchmark":
        benchmark(cfg, plans[0])
    elif args.command == "checkpoints":
        show_checkpoints(cfg, plans, args.json)
    elif args.command == "metrics":
        show_metrics(cfg, plans, args.csv)
    else:
        fit(cfg, plans, args.params, args.task, args.rounds)


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
