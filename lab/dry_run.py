"""`python train.py ... --dry_run`: the plan of a run, printed, and its learning rate plotted; no
run folder is touched.

What the run would use, resolved as train.py resolves it: the model's size and loss path (a model
built on the meta device: no memory, no initialisation), the data (read only for its size; a dataset
not prepared yet is fine unless a duration is in epochs), the batch, the schedule, the optimizer's
groups and the steps that keep a checkpoint.
"""

import os
import tempfile

import torch

from checkpoint import gpt_class
from config import get, parse_duration, parse_mix
from data import build_loaders, dataset_dir, prepare_hint
from optimizer import build_schedule, param_groups
from prepare_data import dataset_ready, ensure_dataset
from lab.auto_batch import resolve_batch_size
from devices import device_kind, pick_device
from plan import describe_run, is_compiled, loss_path_on, make_plan, shares_text
from optimizer import period_ends


def dry_run(cfg):
    """`--dry_run`: resolve what the run would use, print it as a plan, plot the LR, touch no run
    folder. The data is read only for its size; a dataset not prepared yet (FineWeb-Edu before its
    download) is fine unless a duration is in epochs."""
    # torchrun's, without starting a process group
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    mix = parse_mix(cfg.data.mix) or [(cfg.data.dataset, 1.0)]
    stage2_mix = parse_mix(cfg.stage2.mix, "stage2.mix")
    missing = [name for name,
               _ in mix + stage2_mix if not dataset_ready(dataset_dir(cfg.data.data_root, name))]
    in_epochs = [key for key in ("train.max_duration", "train.hard_stop", "stage2.start")
                 if get(cfg, key) and parse_duration(get(cfg, key), key)[1] == "epochs"]
    sequences_per_epoch = None
    if not missing or in_epochs:
        # a missing dataset here is one sentence (a built-in one is prepared)
        for name, _ in mix + stage2_mix:
            ensure_dataset(dataset_dir(cfg.data.data_root, name))
        stage_loaders, _ = build_loaders(cfg, 0, 1, "cpu")
        sequences_per_epoch = stage_loaders[0][1].num_sequences
    device = pick_device(cfg.train.device, "--train.device", world_size)  # as train.py picks it
    device_type = torch.device(device).type
    with torch.device("meta"):  # shapes and counts only: no memory, no initialisation
        raw_model = gpt_class(cfg.train.model_module)(cfg.model, loss_path_on(cfg, device_type))
    # chosen as train.py's build_model chooses it (a CPU is one sentence)
    if cfg.data.batch_size == "auto":
        bf16 = cfg.train.dtype == "bfloat16" or (
            cfg.train.dtype == "auto" and device_kind(device).autocast_dtype() == torch.bfloat16)
        cfg.data.batch_size, why = resolve_batch_size(cfg, raw_model, world_size, device, bf16)
        print(why)
    plan = make_plan(cfg, world_size, (sequences_per_epoch or 0) * cfg.model.block_size,
                     raw_model.num_params(non_embedding=True))
    schedule = build_schedule(cfg.optim, plan.max_steps)
    saves = plan.checkpoint_steps()
    print(describe_run(cfg, raw_model, plan, world_size=world_size, device=device,
                       sequences_per_epoch=sequences_per_epoch,
                       compiled=is_compiled(cfg, torch.device(device).type)))
    if missing:
        hint = prepare_hint(dataset_dir(cfg.data.data_root, missing[0]))[:-1]
        print(f"data: {', '.join(missing)} not prepared yet ({hint})")
    print("data: " + shares_text(mix))
    if plan.stage2_step:
        reference = (cfg.stage2.reference
                     or f"the model at step {plan.stage2_step} (kept as a fixed checkpoint)")
        print(f"stage 2: after step {plan.stage2_step:,} "
              f"({plan.stage2_step * plan.tokens_per_step:,} tokens): data "
              + shares_text(stage2_mix) + f"; CE + {cfg.stage2.kl_beta:g} x KL "
              f"({cfg.stage2.kl_estimator}) toward " + reference)
    print(f"batch: {cfg.data.batch_size} sequences x {cfg.model.block_size} tokens per rank per "
          f"micro-step, {plan.grad_accum_steps} micro-step(s) x {world_size} rank(s) = "
          f"{plan.tokens_per_step:,} tokens per step")
    decay = ""
    if schedule.kind == "wsd":
        decay = f", decay {schedule.decay_steps[0]} steps ({schedule.shape})"
    elif schedule.kind == "wsds":
        decay = (f", periods {list(schedule.periods)} ending at steps {period_ends(schedule)}, "
                 f"decays {list(schedule.decay_steps)} ({schedule.shape})")
    print(f"schedule: {schedule.kind}, peak {schedule.lr:g}, floor {schedule.min_lr:g}, warmup "
          f"{schedule.warmup_steps} steps{decay}")
    if schedule.kind in ("wsd", "wsds") and 1 in schedule.decay_steps and schedule.min_lr == 0:
        print("warning: a decay of one step trains that step at LR 0, so the checkpoint after the "
              "decay equals the one before it; set optim.decay_steps to 2 or more, or optim.min_lr "
              "above 0.")
    for line in describe_optimizer(raw_model, cfg.optim):
        print(f"optimizer: {line}")
    print(f"checkpoints at {len(saves)} step(s): "
          f"{', '.join(map(str, saves[:8]))}{' ...' if len(saves) > 8 else ''}"
          f"{', ' + str(saves[-1]) if len(saves) > 8 else ''}; out_dir {cfg.train.out_dir} (not "
          "touched)")
    marks = [(end, f"period {i + 1}") for i, end in enumerate(period_ends(schedule))]
    if plan.stage2_step:
        marks.append((plan.stage2_step, "stage 2"))
    if plan.end_step < plan.max_steps:
        marks.append((plan.end_step, "hard stop"))
    name = os.path.basename(os.path.normpath(cfg.train.out_dir)) or "run"
    path = plot_schedule(schedule, os.path.join(tempfile.gettempdir(), f"lr_schedule_{name}.png"),
                         marks)
    print(f"learning rate plot: {path}")


def describe_optimizer(model, optim):
    """One line per optimizer: the groups it owns and their parameter counts (for --dry_run)."""
    groups = param_groups(model, optim)
    count = {name: sum(p.numel() for p in params) for name, params in groups.items()}
    lines = []
    if "muon" in groups:
        lines.append(f"Muon: {count['muon']:,} parameters in {len(groups['muon'])} block matrices, "
                     f"LR {optim.muon_lr or optim.lr:g}, weight decay {optim.muon_weight_decay:g}, "
                     f"momentum {optim.muon_momentum:g}")
    lines.append(f"AdamW: {count['decay']:,} parameters with weight decay {optim.weight_decay:g} "
                 f"({len(groups['decay'])} tensors), {count['no_decay']:,} without "
                 f"({len(groups['no_decay'])}), LR {optim.lr:g}, betas ({optim.beta1:g}, "
                 f"{optim.beta2:g})")
    return lines


def plot_schedule(schedule, path, marks=()):
    """A PNG of the LR over the run's steps, with vertical lines at `marks` [(step, label), ...]."""
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    steps = range(1, schedule.total_steps + 1)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(list(steps), [schedule.lr_at(n) for n in steps])
    for step, label in marks:
        ax.axvline(step, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate(label, (step, schedule.lr), rotation=90, fontsize=7, va="top", ha="right")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title(f"{schedule.kind} schedule, {schedule.total_steps:,} steps")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
