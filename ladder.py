"""The model ladder: train a series of sizes with settings derived from the size, then fit a
scaling law to the small ones and check what it predicts for the largest (OLMo-core's ModelLadder,
plus the fit).

    python ladder.py dry-run     FILE [--size=4x32] [--json]  # the plan; touches nothing
    python ladder.py run         FILE --size=4x32             # one size into <dir>/4x32/
    python ladder.py run-all     FILE                         # every unfinished size
    python ladder.py benchmark   FILE --size=4x32             # 100 steps: tokens/s, MFU
    python ladder.py checkpoints FILE [--json]                # planned vs saved
    python ladder.py metrics     FILE [--csv=PATH]            # sizes x checkpoints
    python ladder.py fit         FILE                         # L(N, D), held-out check
    python ladder.py compare     FILE_A FILE_B                # A against B

FILE is a ladder config file, e.g. config/ladder_shakespeare.py (and, to compare it with Muon,
config/ladder_shakespeare_muon.py). It sets the `ladder` section and any training field every run
shares (data, block size, evaluation, logging), with the same syntax and `--section.field=value`
overrides as train.py. What the ladder derives from the size (shape, batch, LR, schedule, length,
checkpoints) comes from the configurator; a file that sets one of those fields is refused.

Each size is an ordinary run: `python train.py <dir>/<size>/config.json` reproduces it, and it
resumes, lists (`checkpoint.py list`) and plots (`tools/plot_metrics.py`) like any other.
"""

import argparse
import copy
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Literal

# Before numpy loads (torch loads it): the fit makes thousands of tiny numpy/scipy calls, which
# OpenBLAS threads slow down tenfold on a busy machine (on 2 busy cores: 56 s a fit, 6 s with one
# thread).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from checkpoint import find_checkpoints, is_complete_checkpoint  # noqa: E402 - after the line above
from config import (Config, ConfigError, LogConfig, UserError, all_keys,  # noqa: E402
                    config_to_dict, field_metadata, get, parse_args, run_command,
                    secret_keys, sections, setting, validate)
from configurator.model import (PARAMS, configure_minimal_device_mesh_spec,  # noqa: E402
                                configure_rank_microbatch_size, memory_fit, model_config,
                                param_counts, shape_of, sized_model)
from configurator.run import (period_multiples, plan_batch, plan_run,  # noqa: E402
                              target_batch_tokens)
from hellaswag_eval import check_names  # noqa: E402
from run_dir import changed_fields  # noqa: E402


def ladder_setting(default, check=None):
    """A field of the ladder section: no resume role (a ladder is not resumed, its sizes are), a
    range check."""
    return setting(None, default, check)


@dataclass(slots=True)
class LadderSettings:
    name: str = ladder_setting("ladder")  # names the runs (<name>-<size>) and their W&B group
    # each size trains into <dir>/<size>/; fit.json and fit.png are written here
    dir: str = ladder_setting("out/ladder")
    # <layers>x<width>, or a GPT-2 size (gpt2, gpt2-medium, ...)
    sizes: list[str] = ladder_setting(["1x32", "2x32", "4x32", "8x32"], "not empty")
    # devices a run may use (torchrun --nproc-per-node)
    max_devices: int = ladder_setting(1, "at least 1")
    # device type, for the micro-batch: cpu, H100, H200, A100-80GB, A100-40GB, ...
    device: str = ladder_setting("cpu")
    # train each size to this many Chinchilla durations: 0.5, 1, 2, 4, ...
    chinchilla_multiple: float = ladder_setting(2.0)
    # one Chinchilla duration in tokens per non-embedding parameter (Hoffmann et al. 2022)
    tokens_per_param: float = ladder_setting(20.0, "greater than 0")
    # scales the peak learning rate the configurator derives
    lr_multiplier: float = ladder_setting(1.0, "greater than 0")
    # each WSD-S period ends with a linear decay over this share of it
    decay_fraction: float = ladder_setting(0.1, "in [0, 1)")
    seed: int = ladder_setting(42)  # train.seed of every size (OLMo-core's ladder default)
    # validation tokens per evaluation, the same first ones for every size (sets eval.val_steps)
    val_tokens: int = ladder_setting(65536, "at least 1")
    # one global batch for every size, in tokens; 0 = OLMo's rule from N (Porian et al. 2024)
    batch_tokens: int = ladder_setting(0, "0 or more")
    # the duration unit in tokens, the same for every size; 0 = one Chinchilla duration
    # (tokens_per_param x N)
    duration_tokens: int = ladder_setting(0, "0 or more")
    # warmup of every size, in tokens; 0 = N tokens (OLMo)
    warmup_tokens: int = ladder_setting(0, "0 or more")
    # tasks whose accuracy `fit` predicts too (two steps: Bhagia et al. 2024); each must be in
    # eval.tasks
    fit_tasks: list[str] = ladder_setting([])
    # optim.name of every size; muon keeps the LR rule (OLMo-core's muon ladder, Liu et al. 2025)
    optimizer: Literal["adamw", "muon"] = ladder_setting("adamw")
    # muon: OLMo's batch rule times this (OLMo-core's muon ladder doubles it); a fixed batch_tokens
    # stays as it is
    muon_batch_multiplier: float = ladder_setting(2.0, "greater than 0")
    # steps between the ephemeral checkpoints saved between the fixed ones, and how soon after a
    # fixed one an ephemeral one is skipped (OLMo-core's ladder: 1000 and 250); 0 = off
    ephemeral_interval: int = ladder_setting(1000, "0 or more")
    ephemeral_cooldown: int = ladder_setting(250, "0 or more")
    # other root folders or bucket URLs (s3://..., file://...) where `metrics`, `checkpoints` and
    # `fit` also look for each size's checkpoints and metrics, after ladder.dir (OLMo-core's
    # alternative_dirs)
    alternative_dirs: list[str] = ladder_setting([])
    # list every checkpoint found in those folders, not only the planned ones (OLMo-core's
    # discover_all)
    discover_all: bool = ladder_setting(False)


@dataclass(slots=True)
class LadderConfig(Config):
    ladder: LadderSettings = field(default_factory=LadderSettings)


# Fields the ladder sets for every size (declared `ladder=True` beside the field); a ladder file
# that sets one would be silently overruled, so it is refused.
DERIVED = [key for key in all_keys(Config()) if field_metadata(Config(), key)["ladder"]]


def read_config(path, overrides):
    """The checked LadderConfig of a ladder file plus overrides; every mistake is one sentence."""
    cfg = parse_args([path, *overrides], LadderConfig())
    check_names(cfg.eval.tasks, "eval.tasks")  # as train.py does
    default = Config()
    for key in DERIVED:
        if get(cfg, key) != get(default, key):
            on_command_line = any(o.startswith(f"--{key}=") for o in overrides)
            where = "the command line" if on_command_line else path
            raise ConfigError(f"{where} sets {key}, which the ladder derives from the model size; "
                              f"remove it (ladder.lr_multiplier, ladder.decay_fraction and "
                              f"ladder.seed are the knobs).")
    L = cfg.ladder
    repeated = sorted({size for size in L.sizes if L.sizes.count(size) > 1})
    if repeated:
        raise ConfigError(f"ladder.sizes names {', '.join(repeated)} more than once; "
                          f"list each size once.")
    for size in L.sizes:
        shape_of(size)  # a name that is not a size is one sentence
    period_multiples(L.chinchilla_multiple)
    missing = [task for task in L.fit_tasks if task not in cfg.eval.tasks]
    if missing:
        raise ConfigError(f"ladder.fit_tasks has {', '.join(missing)}, which eval.tasks does not "
                          f"evaluate; add it to eval.tasks (the ladder evaluates them at its "
                          f"checkpoints).")
    return cfg


# --------------------------------------------------------------------------- the plan of one size


@dataclass(frozen=True)
class SizePlan:
    size: str
    params: dict  # non_embedding, with_output, total
    target_batch_tokens: int
    min_devices: int
    batch: object  # configurator.run.BatchPlan
    run: object  # configurator.run.RunPlan

    @property
    def non_embedding_params(self):
        return self.params["non_embedding"]


def plan_size(cfg, size):
    L = cfg.ladder
    # the run's own GPT (a fork's too), on the meta device
    model = sized_model(size, cfg.model, cfg.train.model_module)
    params = param_counts(model)
    n = params["non_embedding"]
    # Muon tolerates a larger batch: OLMo-core's muon ladder doubles OLMo's target batch.
    multiplier = L.muon_batch_multiplier if L.optimizer == "muon" else 1
    target = L.batch_tokens or round(target_batch_tokens(n) * multiplier)
    min_world_size, min_dp_world_size = configure_minimal_device_mesh_spec(model, size, L.device)
    seq = cfg.model.block_size
    batch = plan_batch(target, configure_rank_microbatch_size(model, L.device), seq, min_world_size,
                       min_dp_world_size, L.max_devices, size)
    run = plan_run(n, batch.batch_tokens, chinchilla_multiple=L.chinchilla_multiple,
                   tokens_per_param=L.tokens_per_param, lr_multiplier=L.lr_multiplier,
                   decay_fraction=L.decay_fraction, duration_tokens=L.duration_tokens,
                   warmup_tokens=L.warmup_tokens)
    return SizePlan(size, params, target, min_world_size, batch, run)


def plan_sizes(cfg, only=None):
    """Plans of the ladder's sizes (or just `only`), smallest first."""
    if only and only not in cfg.ladder.sizes:
        raise ConfigError(f"--size={only} is not in ladder.sizes ({', '.join(cfg.ladder.sizes)}); "
                          f"pick one of those.")
    plans = [plan_size(cfg, size) for size in ([only] if only else cfg.ladder.sizes)]
    return sorted(plans, key=lambda p: p.non_embedding_params)


def run_config(cfg, plan):
    """The ordinary training Config of one size: the shared fields of the ladder file, plus the
    plan."""
    run = Config()
    for name, section in sections(cfg).items():
        if name != "ladder":
            setattr(run, name, copy.deepcopy(section))
    L = cfg.ladder
    run.model = model_config(plan.size, cfg.model)  # the run's model section, at this size
    run.data.batch_size = plan.batch.micro_batch_tokens // cfg.model.block_size
    run.train.total_batch_size, run.train.max_steps = plan.batch.batch_tokens, plan.run.max_steps
    run.train.out_dir, run.train.seed = os.path.join(L.dir, plan.size), L.seed
    o = run.optim
    o.name = L.optimizer
    o.lr, o.min_lr, o.beta2 = plan.run.lr, 0.0, plan.run.beta2
    o.weight_decay, o.decay_embeddings = 0.1, False
    o.schedule, o.periods = "wsds", list(plan.run.periods)
    o.decay_fraction, o.decay_shape = L.decay_fraction, "linear"
    o.warmup_steps = plan.run.warmup_steps
    # Evaluate and checkpoint at the plan's named steps only (the last is the final checkpoint),
    # with OLMo's ladder's ephemeral checkpoints between them (only the newest kept), saved on a
    # thread of their own.
    steps = [step for _, step in plan.run.checkpoints]
    run.eval.interval, run.eval.fixed_steps, run.checkpoint.fixed_steps = 0, steps, steps
    run.checkpoint.interval = 0
    c = run.checkpoint
    c.ephemeral_interval, c.ephemeral_cooldown = L.ephemeral_interval, L.ephemeral_cooldown
    c.async_save = True
    # val batches are whole global batches
    run.eval.val_steps = max(1, round(L.val_tokens / plan.batch.batch_tokens))
    # the ladder's runs go to a W&B project of its name, unless one is set
    default_project = LogConfig().wandb_project
    if run.log.wandb_project == default_project:
        run.log.wandb_project = L.name
    run.log.wandb_group = run.log.wandb_group or L.name
    run.log.wandb_name = run.log.wandb_name or f"{L.name}-{plan.size}"
    validate(run)
    return run


# --------------------------------------------------------------------------------------- commands


def dry_run(cfg, plans, as_json):
    from optimizer import build_schedule
    from lab.dry_run import plot_schedule

    for p in plans:
        b, r = p.batch, p.run
        checkpoints = [{"name": name, "step": step, "tokens": step * b.batch_tokens}
                       for name, step in r.checkpoints]
        if as_json:
            print(json.dumps({"size": p.size, "non_embedding_params": p.non_embedding_params,
                              "total_params": p.params["total"],
                              "target_batch_tokens": p.target_batch_tokens,
                              "batch_tokens": b.batch_tokens,
                              "micro_batch_tokens": b.micro_batch_tokens,
                              "min_devices": p.min_devices, "devices": b.devices,
                              "dp_world_size": b.dp_world_size,
                              "grad_accum_steps": b.grad_accum_steps, "lr": r.lr, "beta2": r.beta2,
                              "warmup_tokens": r.warmup_steps * b.batch_tokens,
                              "duration_tokens": r.duration_tokens,
                              "max_steps": r.max_steps, "checkpoints": checkpoints}))
            continue
        seq, muon = cfg.model.block_size, cfg.ladder.optimizer == "muon"
        model = sized_model(p.size, cfg.model, cfg.train.model_module)
        ddp, fsdp, memory, verdict = memory_fit(model, cfg.ladder.device, b.micro_batch_tokens,
                                                b.devices)
        schedule = build_schedule(run_config(cfg, p).optim, r.max_steps)
        png_path = os.path.join(tempfile.gettempdir(), f"{cfg.ladder.name}_{p.size}_lr.png")
        png = plot_schedule(schedule, png_path, [(step, name) for name, step in r.checkpoints[1:]])
        print(
            f"size {p.size}:\n"
            f"  parameters       {p.non_embedding_params:,} non-embedding, "
            f"{p.params['with_output']:,} with the output layer, {p.params['total']:,} total\n"
            f"  batch            target {p.target_batch_tokens:,} tokens; actual "
            f"{b.batch_tokens:,} tokens = {b.batch_tokens // seq:,} sequences of {seq}\n"
            f"  micro-batch      {b.micro_batch_tokens:,} tokens "
            f"({b.micro_batch_tokens // seq} sequences) per device\n"
            f"  devices          {b.devices} of {cfg.ladder.max_devices} "
            f"(at least {p.min_devices}); data-parallel size {b.dp_world_size}; "
            f"{b.grad_accum_steps} accumulation step(s)\n"
            f"  memory           {ddp:.2f} GB per device with DDP, {fsdp:.2f} GB with FSDP on "
            f"{b.devices}, of {memory:.0f} GB ({cfg.ladder.device}): {verdict} "
            f"(plan.memory_per_rank)\n"
            f"  optimizer        {'Muon for the block matrices + AdamW' if muon else 'AdamW'}, "
            f"peak LR {r.lr:.3g}, beta2 {r.beta2}, weight decay 0.1 (not on embeddings)\n"
            f"  warmup           {r.warmup_steps * b.batch_tokens:,} tokens "
            f"({r.warmup_steps} steps)\n"
            f"  duration         {r.duration_tokens:,} tokens = {r.max_steps:,} steps; "
            f"WSD-S periods {r.periods}\n"
            f"  checkpoints      "
            + ", ".join(f"{c['name']} @ {c['step']}" for c in checkpoints) + "\n"
            f"  LR schedule plot {png}"
        )


def check_world_size(plan):
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != plan.batch.devices:
        launch = (f"torchrun --nproc-per-node={plan.batch.devices} ladder.py ..."
                  if plan.batch.devices > 1 else "python ladder.py ... (one process)")
        raise ConfigError(f"size {plan.size} is planned for {plan.batch.devices} device(s) but "
                          f"this run has {world_size} process(es); launch it as {launch}.")


def changes_the_result(key):
    """A setting whose change makes a trained size another experiment: any that is not `free`, and
    any the plan derives, except where the size's folder lies (a ladder folder may be moved)."""
    if key not in all_keys(Config()):  # a field this version no longer has
        return True
    metadata = field_metadata(Config(), key)
    return (metadata["role"] != "free" or metadata["ladder"]) and key != "train.out_dir"


def size_status(cfg, plan):
    """(status, detail) of a size's folder against its plan: "new" (never started), "partial"
    (started, not at its last step), "finished", or "different" (trained under other settings;
    detail names them)."""
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
                   changed_fields(saved, wanted).items() if changes_the_result(key)]
    if differences:
        return "different", "; ".join(differences)
    finished = is_complete_checkpoint(os.path.join(folder, f"step{plan.run.max_steps}"))
    return ("finished" if finished else "partial"), ""


def refuse_different(cfg, plan, detail):
    raise UserError(f"size {plan.size} in {os.path.join(cfg.ladder.dir, plan.size)} was trained "
                    f"under other settings ({detail}); use another ladder.dir for these settings, "
                    f"or move that folder away to train the size anew.")


def refuse_any_different(cfg, plans):
    """Before a fit: every size's saved config must be its plan's (a size trained under other
    settings would put a point of another law into this one)."""
    for plan in plans:
        status, detail = size_status(cfg, plan)
        if status == "different":
            refuse_different(cfg, plan, detail)


def run(cfg, plan):
    import train

    check_world_size(plan)  # before anything is written
    status, detail = size_status(cfg, plan)
    if status == "different":
        refuse_different(cfg, plan, detail)
    train.train(run_config(cfg, plan))


def webhook_in_environment(cfg, overrides):
    """(overrides, environment) for a size's process, with the webhook in SLACK_WEBHOOK_URL (which
    lab/notifier.py reads when log.slack_webhook is empty), never on its command line: `ps` shows a
    command line to every user of the machine, a process's environment only to its owner."""
    assert secret_keys() == ["log.slack_webhook"], "each secret needs its way into the environment"
    env = dict(os.environ)
    if not cfg.log.slack_webhook:  # none, or SLACK_WEBHOOK_URL's, which the child inherits
        return overrides, env
    env["SLACK_WEBHOOK_URL"] = cfg.log.slack_webhook  # from the ladder file or the command line
    kept = [arg for arg in overrides if not arg.startswith("--log.slack_webhook=")]
    return kept + ["--log.slack_webhook="], env  # (empty: the file's own URL gives way too)


def run_child(command, line, env):
    """Print `line`, then run one size in its own process (with environment `env`); returns (exit
    status, the name of a signal received). The child starts with Ctrl-C ignored, until its
    trainer takes it (a Ctrl-C while it imports would be a traceback); a Ctrl-C or a SIGTERM to
    this process reaches it as a SIGTERM from here, which stops a child still starting at once and
    one that trains after its step and its checkpoint, as Ctrl-C does."""
    child, received = [], []

    def forward(signum, frame):
        received.append(signal.Signals(signum).name)
        if child and child[0].poll() is None:
            child[0].send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(line, flush=True)
        child.append(subprocess.Popen(
            command, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)))
        if received:  # a signal before the child existed
            child[0].send_signal(signal.SIGTERM)
        while True:
            try:
                return child[0].wait(), (received[0] if received else None)
            except KeyboardInterrupt:  # a signal arriving while wait() was being set up
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_all(cfg, plans, config_path, overrides):
    """Each unfinished size in its own process (torchrun when it needs several devices), smallest
    first. A size is skipped only when it finished under the plan's settings; one stopped early
    stops run-all."""
    statuses = [(p, *size_status(cfg, p)) for p in plans]
    for p, status, detail in statuses:  # refuse before training anything
        if status == "different":
            refuse_different(cfg, p, detail)
    todo, timings = [p for p, status, _ in statuses if status != "finished"], []
    overrides, env = webhook_in_environment(cfg, overrides)
    for k, (p, status, _) in enumerate(statuses, 1):
        if status == "finished":
            print(f"size {p.size} ({k} of {len(plans)}): finished "
                  f"({os.path.join(cfg.ladder.dir, p.size)}); skipped")
            continue
        launcher = [sys.executable] if p.batch.devices == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={p.batch.devices}"]
        command = launcher + [os.path.abspath(__file__), "run", config_path, *overrides,
                              f"--size={p.size}"]
        eta = ladder_eta(timings, todo[len(timings):])
        start = time.monotonic()
        code, signal_name = run_child(command, f"size {p.size} ({k} of {len(plans)}, "
                                      f"{p.run.max_steps:,} steps{eta}): "
                                      f"{' '.join(command[1:])}", env)
        timings.append((p, time.monotonic() - start))
        status, detail = size_status(cfg, p)
        if signal_name and not find_checkpoints(os.path.join(cfg.ladder.dir, p.size)):
            raise UserError(f"run-all was stopped by {signal_name} before size {p.size} had "
                            f"trained a step, so nothing of it was saved: run run-all again to "
                            f"start it.")
        if signal_name:
            raise UserError(f"run-all was stopped by {signal_name}; size {p.size} saved a "
                            f"checkpoint of what it had trained: run run-all again to continue "
                            f"from there.")
        if code != 0:
            raise UserError(f"size {p.size} failed (its output is above); fix that, then run "
                            f"run-all again to continue from where it stopped.")
        # its run wrote a config other than the plan: this ladder.py and train.py disagree
        if status == "different":
            refuse_different(cfg, p, detail)
        if status != "finished":
            raise UserError(f"size {p.size} stopped before its last step (a time limit, a CANCEL "
                            f"file or a signal; its output is above); run run-all again to "
                            f"continue from its checkpoint.")


def ladder_eta(timings, left):
    """", about M min left for the ladder": the last trained size's seconds per token and parameter
    (the output layer counted: it is most of a small model's work) times the tokens and parameters
    of the sizes left. A plain per-token rate would promise the larger sizes at the smaller ones'
    speed."""
    if not timings:
        return ""
    last, seconds = timings[-1]
    rate = seconds / (last.run.duration_tokens * last.params["with_output"])
    minutes = rate * sum(p.run.duration_tokens * p.params["with_output"] for p in left) / 60
    return f", about {minutes:.0f} min left for the ladder"


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
    metrics_path = os.path.join(bench.train.out_dir, "metrics.jsonl")
    rows = [r for r in metrics.read_jsonl(metrics_path) if r["step"] > 10]

    def median(name):
        values = [r[name] for r in rows if name in r]
        return statistics.median(values) if values else None

    mfu = median("throughput/mfu")
    peak = max((v for r in rows for k, v in r.items() if k.startswith("system/") and "peak" in k),
               default=0.0)
    mfu_text = ("%.1f%%" % (100 * mfu) if mfu is not None
                else "unknown (peak FLOP/s of this device not known)")
    print(f"benchmark {plan.size}: {median('throughput/tokens_per_sec'):,.0f} tokens/s (median "
          f"after step 10), MFU {mfu_text}, peak memory {peak:.2f} GB; profiler trace in "
          f"{os.path.join(bench.train.out_dir, 'profiler')}")


def show_checkpoints(cfg, plans, as_json):
    from lab import ladder_fit

    for folder in ladder_fit.missing_alternative_dirs(cfg):
        print(f"note: ladder.alternative_dirs has {folder}, which does not exist; no checkpoint "
              f"was looked for there.", file=sys.stderr)  # stderr: --json's lines stay JSON
    for p in plans:
        for c in ladder_fit.checkpoint_rows(cfg, p):
            if as_json:
                print(json.dumps({"size": p.size, **c}))
            else:
                mark = "✔" if c["exists"] else "✘"
                print(f"{mark} {p.size:<8} step {c['step']:>7,} ({c['tokens']:>12,} tokens) "
                      f"{c['name']:<20} {c['path']}"
                      + (f"\n    metrics: {c['metrics']}" if c["metrics"] else ""))


def metrics_table(cfg, plans):
    """[{size, checkpoint, step, tokens, non_embedding_params, <each metric saved at the step>}]."""
    from lab import ladder_fit

    table = []
    for p in plans:
        for c in ladder_fit.checkpoint_rows(cfg, p):
            if c["metrics"]:
                saved = ladder_fit.read_metrics_file(c["metrics"])
                saved.pop("step", None)
                table.append({"size": p.size, "checkpoint": c["name"], "step": c["step"],
                              "tokens": c["tokens"], "non_embedding_params": p.non_embedding_params,
                              **saved})
    return table


def show_metrics(cfg, plans, csv_path):
    table = metrics_table(cfg, plans)
    if not table:
        raise UserError(f"no size under {cfg.ladder.dir} has saved metrics yet; train some with "
                        f"run or run-all.")
    columns = list(dict.fromkeys(["size", "checkpoint", "step", "tokens", "val/loss"]
                                 + [k for row in table for k in sorted(row)
                                    if k != "non_embedding_params"]))
    if csv_path:
        import csv

        try:
            with open(csv_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns + ["non_embedding_params"])
                writer.writeheader()
                writer.writerows(table)
        except OSError as error:
            raise UserError(f"cannot write --csv={csv_path} ({error.strerror or error}); give a "
                            f"path in a folder that exists and that you can write to.") from None
    shown = [c for c in columns
             if c in ("size", "checkpoint", "step", "tokens") or c.startswith(("val/", "eval/"))]
    cell = lambda v: f"{v:.4f}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(cell(r.get(c, ""))) for r in table)) for c in shown]
    print("  ".join(c.ljust(w) for c, w in zip(shown, widths)))
    for row in table:
        print("  ".join(cell(row.get(c, "")).ljust(w) for c, w in zip(shown, widths)))
    if csv_path:
        print(f"all {len(columns)} columns written to {csv_path}")


# ------------------------------------------------------------------------------- the command line

COMMANDS = ("dry-run", "run", "run-all", "benchmark", "checkpoints", "metrics", "fit", "compare")


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Any other --section.field=value overrides the "
                                            "ladder file(s), as in train.py.")
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("config", nargs="+",
                        help="a ladder config file, e.g. config/ladder_shakespeare.py (compare: "
                             "two of them, A then B)")
    parser.add_argument("--size", help="one size of ladder.sizes (run and benchmark need it)")
    parser.add_argument("--json", action="store_true", help="dry-run, checkpoints: JSON lines")
    parser.add_argument("--csv", help="metrics: also write every column to this CSV file")
    parser.add_argument("--params", default="non_embedding", choices=PARAMS,
                        help="fit, compare: what N counts (default: non_embedding, Kaplan et al.)")
    parser.add_argument("--task",
                        help="fit: also predict this task's accuracy (two steps: Bhagia et al. "
                             "2024)")
    parser.add_argument("--rounds", type=int, default=200,
                        help="fit, compare: bootstrap refits for the intervals")
    args, overrides = parser.parse_known_args(argv)
    compare = args.command == "compare"
    if len(args.config) != (2 if compare else 1):
        takes = "two ladder files (A, then B)" if compare else "one ladder file"
        second = " config/ladder_shakespeare_muon.py" if compare else ""
        raise UserError(f"{args.command} takes {takes}, and {len(args.config)} were given; e.g. "
                        f"python ladder.py {args.command} config/ladder_shakespeare.py{second}.")
    if args.rounds < 0:
        raise UserError(f"--rounds={args.rounds} must be 0 or more; give the number of bootstrap "
                        f"refits.")
    if args.command == "compare":
        ladders = [(path, cfg, plan_sizes(cfg))
                   for path in args.config for cfg in [read_config(path, overrides)]]
        for _, cfg, plans in ladders:
            refuse_any_different(cfg, plans)
        from lab import ladder_fit
        return ladder_fit.compare(*ladders, args.params, args.rounds)
    cfg = read_config(args.config[0], overrides)
    if args.task:
        check_names([args.task], "--task")
        if args.task not in cfg.eval.tasks:
            raise UserError(f"--task={args.task} is not among eval.tasks of {args.config[0]}, so "
                            f"the ladder has no scores for it; add it to eval.tasks and train the "
                            f"sizes.")
    if args.command in ("run", "benchmark") and not args.size:
        raise UserError(f"{args.command} trains one size; add --size=NAME, one of "
                        f"{', '.join(cfg.ladder.sizes)}.")
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
        refuse_any_different(cfg, plans)
        from lab import ladder_fit
        ladder_fit.fit(cfg, plans, args.params, args.task, args.rounds)


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
