"""Train a GPT. This file is the table of contents of the whole trainer: read it top to bottom.

    python train.py                                      # Shakespeare on a laptop CPU (config/shakespeare.py)
    python train.py config/gpt2.py --train.max_steps=100 # any config file, with dotted overrides
    torchrun --nproc-per-node=8 train.py config/gpt2.py  # GPT-2 (124M) on FineWeb-Edu, 8 GPUs

The story: read the config, set up DDP from torchrun's environment, build data, model and optimizer,
then loop: learning rate, forward/backward over micro-steps, clip, step, and at their intervals
validation, samples and logs. Each feature lives in a small module and is called from one line here.
"""

import json
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hellaswag_eval
import metrics
from callbacks import (GarbageCollector, LossSpikeDetector, NonFiniteLoss, check_finite, duration_to_steps,
                       in_ranges, make_profiler, memory_metrics, parse_step_ranges, per_layer_grad_norms,
                       save_environment, speed_metrics)
from checkpoint import (CheckpointError, Checkpointer, capture_state, checkpoint_kind, choose_checkpoint,
                        claim_run_dir, load_checkpoint, remove_incomplete)
from configurator import ConfigError, config_to_dict, parse_args
from data import DataError, TokenLoader, ensure_dataset
from model import GPT, peak_flops_for_device
from sample import generate_text
from stopping import SignalFlag, agree_on_stop, describe_stop, local_stop_reason


def setup_distributed(device_choice):
    """Read torchrun's environment. One process per GPU with NCCL; on CPU the same code runs with gloo.
    Returns (rank, world_size, device, cpu_group); cpu_group carries small host-side agreements."""
    want_cuda = device_choice.startswith("cuda") or (device_choice == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:  # a plain `python train.py`
        device = ("cuda" if want_cuda else "cpu") if device_choice == "auto" else device_choice
        return 0, 1, device, None
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local_rank}" if want_cuda else "cpu"
    if want_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if want_cuda else "gloo")
    # NCCL collectives run on the GPU stream; a gloo group lets ranks agree on CPU values (stop now?)
    # without waiting for the GPU. On CPU the default group is gloo already.
    cpu_group = dist.new_group(backend="gloo") if want_cuda else None
    return rank, dist.get_world_size(), device, cpu_group


def get_lr(step, cfg, max_steps):
    """Linear warmup to optim.lr, then cosine decay to optim.min_lr at max_steps (GPT-3, appendix B)."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = min(1.0, (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps))
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (o.lr - o.min_lr)


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


def main(argv):
    # ---- configuration and processes
    cfg = parse_args(argv)
    rank, world_size, device, cpu_group = setup_distributed(cfg.train.device)
    is_master = rank == 0  # rank 0 alone prints and writes files
    device_type = torch.device(device).type
    use_bf16 = cfg.train.dtype == "bfloat16" or (
        cfg.train.dtype == "auto" and device_type == "cuda" and torch.cuda.is_bf16_supported())
    # bf16 autocast: matmuls in bfloat16, weights and optimizer state stay float32 (no loss scaling needed).
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    torch.manual_seed(cfg.train.seed)  # the same on every rank, so every replica starts identical
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls for the few float32 ones left

    # ---- batch arithmetic: total_batch_size tokens per step = micro-batches x ranks x accumulation
    tokens_per_micro_step = cfg.data.batch_size * cfg.model.block_size * world_size
    if cfg.train.total_batch_size % tokens_per_micro_step:
        raise ConfigError(
            f"train.total_batch_size={cfg.train.total_batch_size} is not a multiple of data.batch_size "
            f"x model.block_size x world_size = {cfg.data.batch_size} x {cfg.model.block_size} x "
            f"{world_size} = {tokens_per_micro_step}; change one of them so it divides.")
    grad_accum_steps = cfg.train.total_batch_size // tokens_per_micro_step

    # ---- data
    data_dir = os.path.join(cfg.data.data_root, cfg.data.dataset)
    if is_master:
        ensure_dataset(data_dir)
    if world_size > 1:
        dist.barrier()  # the others wait until rank 0 has prepared the data
    loader_args = dict(batch_size=cfg.data.batch_size, block_size=cfg.model.block_size,
                       rank=rank, world_size=world_size, device=device)
    train_loader = TokenLoader(data_dir, "train", shuffle=cfg.data.shuffle, seed=cfg.train.seed, **loader_args)
    val_loader = TokenLoader(data_dir, "val", **loader_args)

    # ---- model and optimizer
    raw_model = GPT(cfg.model).to(device)
    model = raw_model
    if cfg.train.compile == "true" or (cfg.train.compile == "auto" and device_type == "cuda"):
        model = torch.compile(model)
    if world_size > 1:
        model = DDP(model, device_ids=[device] if device_type == "cuda" else None)
    optimizer = raw_model.configure_optimizers(
        cfg.optim.weight_decay, cfg.optim.lr, (cfg.optim.beta1, cfg.optim.beta2), cfg.optim.eps, device_type)
    peak_flops = peak_flops_for_device(device, cfg.train.peak_flops)
    flops_per_token = raw_model.flops_per_token()
    max_steps = cfg.train.max_steps  # the LR schedule's length; train.max_duration sets it in other units
    if cfg.train.max_duration:
        max_steps = duration_to_steps(cfg.train.max_duration, cfg.train.total_batch_size,
                                      train_loader.num_sequences * cfg.model.block_size, raw_model.num_params(True))
    sample_generator = torch.Generator(device).manual_seed(cfg.train.seed + rank)

    # ---- resume from a checkpoint, or claim the run folder for a fresh start
    out_dir, ck = cfg.train.out_dir, cfg.checkpoint
    if is_master:
        remove_incomplete(out_dir)  # what a crash in the middle of a save left behind
    if world_size > 1:
        dist.barrier()
    path, resuming = choose_checkpoint(out_dir, ck.load, ck.load_path)
    step, tokens_seen = 0, 0  # optimizer steps completed, training tokens consumed
    best_val_loss = torch.tensor(math.inf, device=device)
    saved = None
    if path:
        saved = load_checkpoint(path, raw_model, optimizer, sample_generator, rank,
                                load_optim=resuming or ck.load_optim,
                                load_trainer_state=resuming or ck.load_trainer_state)
    if saved:
        step, tokens_seen = saved["step"], saved["tokens"]
        train_loader.load_state_dict(saved["data"])  # the data position is global: any world size works
        best_val_loss = saved["best_val_loss"].to(device)
    if is_master:
        if not resuming:
            claim_run_dir(out_dir, config_to_dict(cfg), ck.save_overwrite)
        os.makedirs(out_dir, exist_ok=True)
        metrics.truncate_jsonl(os.path.join(out_dir, "metrics.jsonl"), after_step=step)  # those steps run again
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config_to_dict(cfg), f, indent=2)
        save_environment(out_dir, world_size)
        print(f"model: {raw_model.num_params():,} parameters ({raw_model.num_params(True):,} non-embedding); "
              f"{world_size} rank(s) on {device}, {grad_accum_steps} micro-step(s) per step, "
              f"{train_loader.num_sequences:,} training sequences per epoch, {max_steps:,} steps"
              + (f"; resumed from {path} at step {step}" if path else ""))
    # Async bookkeeping gets a gloo group of its own: its collectives run on another thread.
    bookkeeping_group = dist.new_group(backend="gloo") if cfg.log.async_bookkeeping and world_size > 1 else None
    recorder = metrics.MetricRecorder(device, world_size, cfg.log.async_bookkeeping, bookkeeping_group)
    sinks = metrics.Sinks(out_dir, cfg.log, config_to_dict(cfg)) if is_master else None
    checkpointer = Checkpointer(out_dir, ck.keep_last, ck.async_save, is_master)
    stop_flag, start_time = SignalFlag(), time.monotonic()
    end_step = min(max_steps, cfg.train.hard_stop or max_steps)
    skip_ranges = parse_step_ranges(cfg.train.steps_to_skip)
    garbage_collector = GarbageCollector(cfg.train.gc_interval)
    profiler_context = make_profiler(cfg.log.profile and is_master, out_dir, rank, cfg.log.profile_wait,
                                     cfg.log.profile_warmup, cfg.log.profile_active)
    hellaswag_examples = []
    if cfg.eval.hellaswag_interval:
        if is_master:
            hellaswag_eval.load_examples(cfg.eval.hellaswag_data)  # downloads once, into the cache
        if world_size > 1:
            dist.barrier()
        hellaswag_examples = hellaswag_eval.load_examples(cfg.eval.hellaswag_data)
        hellaswag_examples = hellaswag_examples[: cfg.eval.hellaswag_limit or None]
    handle_rows = row_handler(cfg, sinks, LossSpikeDetector(cfg.train.loss_spike_threshold), end_step)
    val_loaders = {"val": val_loader}  # the LM evaluator: val/loss, then val/<name>/loss per extra set
    for name in cfg.eval.extra_datasets:
        val_loaders[f"val/{name}"] = TokenLoader(os.path.join(cfg.data.data_root, name), "val", **loader_args)

    # ---- the training loop
    try:
        with profiler_context as profiler:
            while step < end_step:
                step_start = time.perf_counter()
                lr = get_lr(step, cfg, max_steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                if in_ranges(step + 1, skip_ranges):
                    # A known-bad stretch of data: read past its batches without training on them.
                    train_loader.skip_batches(grad_accum_steps)
                    recorder.record_metric("train/skipped_data_step", 1.0)
                    data_time = 0.0
                else:
                    loss_sum, data_time = forward_backward(model, train_loader, grad_accum_steps, autocast, world_size)
                    # clip_grad_norm_ returns the norm before clipping; an infinite limit measures only.
                    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.optim.grad_clip or math.inf)
                    if cfg.log.grad_norms_interval and (step + 1) % cfg.log.grad_norms_interval == 0:
                        for name, value in per_layer_grad_norms(raw_model).items():
                            recorder.record_metric(name, value)
                    # nan_policy=skip needs to know now, which costs one host-device sync per step.
                    if cfg.train.nan_policy == "skip" and not torch.isfinite(loss_sum + grad_norm).item():
                        recorder.record_metric("train/skipped_nonfinite_step", 1.0)
                    else:
                        optimizer.step()
                        recorder.record_metric("train/loss", loss_sum)
                        recorder.record_metric("train/grad_norm", grad_norm)
                    optimizer.zero_grad(set_to_none=True)
                step, tokens_seen = step + 1, tokens_seen + cfg.train.total_batch_size
                for name, value in speed_metrics(time.perf_counter() - step_start, data_time,
                                                 cfg.train.total_batch_size, cfg.model.block_size, tokens_seen,
                                                 flops_per_token, world_size, peak_flops).items():
                    recorder.record_metric(name, value)
                recorder.record_metric("optim/lr", lr)
                recorder.record_metric("tokens", tokens_seen)

                stop_reason = agree_on_stop(local_stop_reason(stop_flag, out_dir, start_time, cfg.train.time_limit,
                                                              is_master), cpu_group)
                last_step = step == end_step or bool(stop_reason)
                if (cfg.eval.interval and (step % cfg.eval.interval == 0 or last_step)) or step in cfg.eval.fixed_steps:
                    for prefix, loader in val_loaders.items():
                        val_loss = validation_loss(model, loader, cfg.eval.val_steps * grad_accum_steps, autocast)
                        recorder.record_metric(f"{prefix}/loss", val_loss)
                        if prefix == "val":
                            best_val_loss = torch.minimum(best_val_loss, val_loss)
                if hellaswag_examples and (step % cfg.eval.hellaswag_interval == 0 or last_step
                                           or step in cfg.eval.fixed_steps):
                    # The raw model: variable-length batches would make torch.compile recompile.
                    with autocast:
                        scores = hellaswag_eval.evaluate(raw_model, hellaswag_examples, device,
                                                         cfg.eval.hellaswag_batch_size, rank, world_size)
                    recorder.record_metric("hellaswag/acc", scores["acc"])
                    recorder.record_metric("hellaswag/acc_norm", scores["acc_norm"])
                if is_master and cfg.eval.sample_interval and (step % cfg.eval.sample_interval == 0 or last_step):
                    write_samples(raw_model, cfg, step, device, sample_generator)
                garbage_collector.step(step)
                checkpoint_due = checkpoint_kind(step, cfg, final=last_step)

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
                    trainer_state = {"step": step, "tokens": tokens_seen, "epoch": train_loader.epoch,
                                     "data": train_loader.state_dict(), "best_val_loss": best_val_loss,
                                     "config": config_to_dict(cfg), "world_size": world_size}
                    snapshot = capture_state(raw_model, optimizer, trainer_state, sample_generator, is_master)
                    checkpointer.save(step, snapshot, checkpoint_due)
                    if is_master:
                        print(f"checkpoint step{step} ({checkpoint_due}, {'async' if ck.async_save else 'sync'}): "
                              f"the loop stalled {time.perf_counter() - stall_start:.3f} s", flush=True)
                profiler.step()
                if stop_reason:
                    if is_master:
                        print(f"{describe_stop(stop_reason, stop_flag, out_dir)} after step {step}; the checkpoint "
                              f"is saved: run the same command again to resume.", flush=True)
                    break
        recorder.wait()  # the last metrics, when they are written on a thread
    finally:
        recorder.close()
        checkpointer.wait()  # a save still in flight must land before the process exits
        garbage_collector.close()
        if sinks:
            sinks.close()

    if is_master and saved and saved["step"] >= end_step:
        print(f"{out_dir} is already trained to step {saved['step']}; nothing to do "
              f"(raise train.max_steps to train longer).")
    if world_size > 1:
        dist.destroy_process_group()


def row_handler(cfg, sinks, spikes, end_step):
    """What happens to collected metrics (on the main thread, or the bookkeeping thread): flag loss
    spikes, write the sinks on rank 0, and with nan_policy=stop end the run on NaN/Inf."""
    def handle_rows(rows):
        for step, values in rows:
            if "train/loss" in values and spikes.is_spike(values["train/loss"]):
                values["train/loss_spike"] = 1.0
            if sinks:
                sinks.write(step, values, print_line=step % cfg.log.interval == 0 or step == end_step
                            or "train/loss_spike" in values)
            if cfg.train.nan_policy == "stop":
                check_finite(step, values)
    return handle_rows


def forward_backward(model, loader, grad_accum_steps, autocast, world_size):
    """One step's gradients over its micro-steps; returns (mean loss on device, seconds reading data)."""
    loss_sum = torch.zeros((), device=loader.device)
    data_time = 0.0
    for micro_step in range(grad_accum_steps):
        data_start = time.perf_counter()
        x, y = loader.next_batch()
        data_time += time.perf_counter() - data_start
        # Gradients are all-reduced across ranks only on the last micro-step; syncing on every
        # micro-step would send the same amount of data grad_accum_steps times.
        last_micro_step = micro_step == grad_accum_steps - 1
        with model.no_sync() if world_size > 1 and not last_micro_step else nullcontext(), autocast:
            _, loss = model(x, y)
        # The loss is a mean over one micro-batch; dividing by the number of micro-steps makes the
        # summed gradients the mean over the whole batch, as if it were one big forward pass.
        loss = loss / grad_accum_steps
        loss_sum += loss.detach()
        loss.backward()
    if world_size > 1:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # on device: no host sync
    return loss_sum, data_time


def write_samples(raw_model, cfg, step, device, generator):
    texts = generate_text(raw_model, cfg.eval.sample_prompt, cfg.eval.num_samples, cfg.eval.sample_tokens,
                          cfg.eval.sample_temperature, cfg.eval.sample_top_k, device, generator)
    with open(os.path.join(cfg.train.out_dir, "samples.txt"), "a") as f:
        for i, text in enumerate(texts):
            block = f"--- step {step}, sample {i}\n{text}\n"
            print(block, end="")
            f.write(block)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, DataError, CheckpointError, NonFiniteLoss, hellaswag_eval.HellaSwagError) as error:
        # Every rank hits the same mistake; one copy of the sentence is enough.
        sys.exit(f"error: {error}" if os.environ.get("RANK", "0") == "0" else 2)
