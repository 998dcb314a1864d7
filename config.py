"""Every setting of a training run, in one place.

A run is configured by a `Config`: one typed dataclass section per concern. Each field has a type,
a default that works and a comment; `python train.py --help` prints exactly these comments. How
config files and command-line overrides set these fields lives in `configurator/`.
"""

from dataclasses import dataclass, field

from model import GPTConfig


@dataclass(slots=True)
class DataConfig:
    dataset: str = "shakespeare"  # a folder under data_root holding train_*.npy and val_*.npy shards
    data_root: str = "data"  # where prepared datasets live (`python data.py ...` writes there)
    batch_size: int = 16  # sequences per rank per micro-step (lower it if you run out of memory)
    shuffle: bool = True  # visit the training sequences in a fresh seeded order every epoch


@dataclass(slots=True)
class TrainConfig:
    total_batch_size: int = 524288  # tokens per optimizer step, summed over ranks and micro-steps
    max_steps: int = 19073  # optimizer steps of the whole run; the LR schedule ends here
    device: str = "auto"  # auto (CUDA when present, else CPU), cpu, cuda, or cuda:N
    dtype: str = "auto"  # auto (bfloat16 on GPUs that have it, else float32), float32, bfloat16
    compile: str = "auto"  # torch.compile: auto (on for CUDA, off on CPU where it is slower), true, false
    seed: int = 1337  # seeds model init, data order and sampling
    out_dir: str = "out"  # run folder: config, metrics, samples and checkpoints go here
    peak_flops: float = 0.0  # the accelerator's peak FLOP/s for MFU; 0 looks it up for known GPUs
    max_duration: str = ""  # run length instead of max_steps: 5000steps, 2e9tokens, 3epochs, 1chinchilla
    hard_stop: int = 0  # stop (with a checkpoint) after this step without changing the LR schedule; 0 = off
    time_limit: float = 0.0  # wall-clock seconds after which the run saves a checkpoint and stops; 0 = off
    steps_to_skip: str = ""  # steps whose batches are read but not trained on, e.g. 100-200,5000-5010 (end excluded)
    nan_policy: str = "stop"  # NaN/Inf loss or gradient: stop (checked when metrics are collected) or skip the step (one sync per step)
    loss_spike_threshold: float = 1.0  # flag a loss this many nats above the mean of the previous 50; 0 = off
    gc_interval: int = 1000  # disable automatic garbage collection and collect every N steps on all ranks; 0 = automatic


@dataclass(slots=True)
class OptimConfig:
    lr: float = 6e-4  # peak learning rate, reached after warmup (GPT-3 paper, 125M model)
    min_lr: float = 6e-5  # learning rate at the end of the cosine decay (10% of lr, Chinchilla)
    warmup_steps: int = 715  # linear warmup steps (375M tokens at 524,288 tokens/step, as GPT-3)
    weight_decay: float = 0.1  # AdamW decoupled weight decay on matrices only (GPT-3)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay (0.95 rather than 0.999 for stability, GPT-3)
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables clipping


@dataclass(slots=True)
class EvalConfig:
    interval: int = 250  # steps between validation-loss evaluations; 0 disables them
    val_steps: int = 20  # validation batches of train.total_batch_size tokens (the same ones every time)
    sample_interval: int = 250  # steps between text samples; 0 disables sampling
    num_samples: int = 2  # samples written each time
    sample_tokens: int = 64  # new tokens per sample
    sample_prompt: str = "\n"  # text the samples start from
    sample_temperature: float = 0.8  # below 1 is more conservative, above 1 more surprising
    sample_top_k: int = 200  # sample only among the k most likely tokens; 0 for all
    fixed_steps: list[int] = field(default_factory=list)  # also evaluate at these steps
    hellaswag_interval: int = 0  # steps between HellaSwag evaluations (also at fixed_steps and the end); 0 = off
    hellaswag_limit: int = 0  # score only the first N examples (0 = all 10,042)
    hellaswag_data: str = ""  # a hellaswag jsonl file; empty downloads and caches the validation set
    hellaswag_batch_size: int = 16  # examples per forward pass (each is 4 rows)
    extra_datasets: list[str] = field(default_factory=list)  # more datasets under data_root whose val split is evaluated too (val/<name>/loss)


@dataclass(slots=True)
class LogConfig:
    interval: int = 10  # steps between console lines
    metrics_collect_interval: int = 10  # steps between collecting metrics to the host (one sync and one collective each)
    async_bookkeeping: bool = False  # reduce and write metrics on a background thread over a gloo group
    grad_norms_interval: int = 0  # steps between per-layer gradient norms (grad/...); 0 = off
    wandb: bool = False  # log to Weights & Biases (WANDB_MODE=offline works without a network)
    wandb_project: str = "nanogpt-lab"  # W&B project
    wandb_name: str = ""  # W&B run name; empty uses the name of train.out_dir
    wandb_group: str = ""  # W&B group, e.g. to gather the runs of a sweep
    wandb_tags: list[str] = field(default_factory=list)  # W&B tags
    profile: bool = False  # record a torch.profiler trace of a few steps into <out_dir>/profiler/
    profile_wait: int = 5  # steps to skip before profiling (startup is not typical)
    profile_warmup: int = 1  # steps profiled but discarded (the profiler's own warmup)
    profile_active: int = 3  # steps recorded in the trace


@dataclass(slots=True)
class CheckpointConfig:
    interval: int = 1000  # steps between permanent checkpoints; 0 = only the final one
    keep_last: int = 3  # permanent checkpoints to keep (older ones are deleted); 0 keeps all
    ephemeral_interval: int = 0  # steps between ephemeral checkpoints (only the newest is kept); 0 = off
    fixed_steps: list[int] = field(default_factory=list)  # steps whose checkpoints are always kept
    async_save: bool = False  # copy state to CPU in the step, write it on a background thread
    load: str = "if_available"  # if_available (resume from out_dir when it has one), always, never
    load_path: str = ""  # checkpoint or run folder to start from when out_dir has none (fine-tuning)
    load_optim: bool = True  # with load_path: also load the optimizer state
    load_trainer_state: bool = True  # with load_path: also load step, data position and RNG
    save_overwrite: bool = False  # allow replacing a different run already in out_dir


@dataclass(slots=True)
class Config:
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
