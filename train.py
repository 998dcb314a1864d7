"""Train a GPT. This file is the table of contents of the whole trainer: read it top to bottom.

    python train.py                                      # Shakespeare on a laptop CPU (config/shakespeare.py)
    python train.py config/gpt2.py --train.hard_stop=100 # any config file, with dotted overrides
    python train.py config/gpt2.py --dry_run             # print the plan and plot the LR; touch nothing
    torchrun --nproc-per-node=8 train.py config/gpt2.py  # GPT-2 (124M) on FineWeb-Edu, 8 GPUs

`main` checks the config; `train` is the loop. Each step sets the learning rate, takes one `train_step` (right below
the loop: forward and backward over the micro-steps, clip, optimizer step), records its metrics, then runs what the
plan says is due, in a fixed order: evaluate, print, checkpoint, sample. Then the evaluations, and `build_run`, which
sets the run up part by part. Every feature is called from a visible line here, the optional ones imported where used.
"""

import dataclasses
import datetime
import functools
import os
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import metrics
import run_dir
from callbacks import LossSpikeDetector, all_finite, memory_metrics, peak_flops_for_device, save_environment
from checkpoint import (MARKER, CheckpointError, Checkpointer, TrainState, capture_state, is_sharded, load_checkpoint,
                        model_code)
from config import ConfigError, check_torch, check_warmup, config_to_dict, parse_args, run_command
from data import build_loaders, dataset_dir, dataset_names, fingerprint, rank0_first, shard_paths, tokenizer_of
from metrics import StepClock, speed_metrics
from model import GPT, choose_loss_path, gpt_class
from optimizer import build_optimizer, build_schedule, set_lr
from plan import Due, Every, Plan, SignalFlag, Stopper, describe_run, is_compiled, make_plan, shares_text


# ----------------------------------------------------------------------------- the command line


def main(argv):
    """Every mistake a user can make in the config fails here, in one sentence, before any file is touched."""
    check_torch(torch.__version__)
    args = [a for a in argv if a != "--dry_run"]
    cfg = parse_args(args)
    if cfg.eval.tasks:
        from hellaswag_eval import check_names
        check_names(cfg.eval.tasks, "eval.tasks")  # the names hellaswag_eval.py defines
    for name in [cfg.data.dataset, *cfg.eval.extra_datasets, *dataset_names(cfg)]:
        dataset_dir(cfg.data.data_root, name)  # a name that leaves the data root: one sentence, before any lock
    try:
        gpt_class(cfg.train.model_module)  # a model file without a GPT, or without what the trainer asks of it
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if cfg.train.device != "auto":
        from sample import check_device
        check_device(cfg.train.device, "--train.device")  # a GPU this torch does not see
    if not cfg.train.max_duration:  # (a duration in tokens or epochs is checked by make_plan, once data is read)
        check_warmup(cfg.optim.warmup_steps, cfg.train.max_steps)
    if cfg.train.no_checkpoints:  # a benchmark: nothing is loaded or saved, so where from and to is not checked
        cfg.checkpoint = dataclasses.replace(cfg.checkpoint, load="never", load_path="", remote_folder="")
    if cfg.checkpoint.remote_folder:  # credentials, bucket, endpoint: one sentence now, not at the first upload
        from lab import remote
        remote.check(cfg.checkpoint.remote_folder, cfg.train.out_dir)
    if cfg.checkpoint.load_path:  # a GPT-2's shape, or one sentence for a typo (load_path.py)
        from load_path import use_load_path_shape
        use_load_path_shape(cfg, default_config=not args or args[0].startswith("--"))
    if cfg.stage2.reference:  # needed only when stage 2 begins, hours from now: checked now (with the run's shape)
        from lab.stage2 import check_reference
        check_reference(cfg.stage2.reference, cfg.model, cfg.stage2.kl_estimator)
    if "--dry_run" in argv:  # the plan, printed (dry_run.py)
        from lab.dry_run import dry_run
        return dry_run(cfg)
    train(cfg)


# ----------------------------------------------------------------------------- the loop


def train(cfg):
    """Train the run `cfg` describes (ladder.py calls this too, with a config it built)."""
    with ExitStack() as stack:
        run = build_run(cfg, stack)
        plan, state, recorder, extras = run.plan, run.state, run.recorder, run.extras
        before_the_first_step(run)
        clock = StepClock(run.device)  # the steps' times, with what runs beside them (evaluations, ...) set aside
        mix, loader, objective = run.stages.at(state.step + 1)  # objective: None, or stage 2's CE + beta x KL
        stop = ""
        while state.step < plan.end_step:
            step = state.step + 1  # the step being taken, as logged
            if step - 1 == plan.stage2_step:  # stage 2 begins: its data mixture and its objective (stage2.py)
                mix, loader, objective = run.stages.at(step)
            lrs = set_lr(run.optimizer, run.schedule.lr_at(step), cfg.optim.lr)  # each group from its own peak
            if step in extras.steps:  # traces, skipped data, NaN skipping, compile time, GC, profiler: step_extras.py
                step_metrics, data_time = extras.step(run, step, loader, objective, clock, train_step)
            else:
                step_metrics, data_time = train_step(run.model, run.optimizer, loader, plan.grad_accum_steps,
                                                     run.autocast, grad_clip=cfg.optim.grad_clip, objective=objective)
            trained = "train/loss" in step_metrics  # a step skipped (its data, a non-finite loss) trained nothing
            state.step, state.tokens = step, state.tokens + plan.tokens_per_step * trained
            step_time, aside = clock.lap()  # from the end of the previous step, the GPU's work included
            if trained:  # tokens/s, MFU, ...
                step_metrics.update(speed_metrics(
                    step_time=step_time, data_time=data_time, tokens_per_step=plan.tokens_per_step,
                    block_size=cfg.model.block_size, tokens_seen=state.tokens, flops_per_token=run.flops_per_token,
                    world_size=run.world_size, peak_flops=run.peak_flops))
            # Every rank records the same names (one vector for all ranks); the time beside the step is the slowest
            # rank's, which the loop waited for; a checkpoint's time goes in its own step's row (Run.save).
            recorder.record_all({**step_metrics, **lrs, "tokens": state.tokens, **loader.metrics()})
            recorder.record_all({f"throughput/{kind}_time_sec": s for kind, s in aside.items() if kind != "checkpoint"},
                                reduce="max")

            # ---- after the step, in this order: stop?, NaN?, evaluate, metrics, checkpoint, samples. A part that
            # fails cannot lose the training done, and NaN weights are caught before anything reads them. On a
            # stop (a scheduler's grace period is short) only the checkpoint runs.
            stop = run.stopper.poll(step)  # a signal, CANCEL, the time limit or a write error, agreed by every rank
            due = plan.due(step, last=step == plan.end_step, stop=bool(stop))
            # One host sync, only when something reads the weights; a non-finite step cancels it all (see below).
            nonfinite = due.output and cfg.train.nan_policy == "stop" and not all_finite(step_metrics)
            due = Due() if nonfinite else due
            if due.evals:
                with clock.aside("eval"):
                    scores = evaluate(run, due, mix)
                recorder.record_all(scores)
                state.keep_best(scores.get("val/loss"))
            if due.collect:
                recorder.record_all(memory_metrics(run.device), reduce="max")
                if cfg.checkpoint.remote_folder:  # the bucket's uploads (rank 0 uploads; every rank records them)
                    recorder.record_all(run.checkpointer.upload_metrics(), reduce="max")
            # The rows collected go to metrics.jsonl and come back as the console lines to print (rank 0).
            halt = nonfinite or bool(extras.give_up)  # the run ends below: its rows first
            for line in recorder.finish_step(step, due.collect or halt, wait=bool(due.checkpoint) or halt):
                print(line, flush=True)
            if cfg.log.all_ranks and not run.is_master and (step % cfg.log.interval == 0 or step == plan.end_step):
                from lab.step_extras import rank_line  # log.all_ranks: this rank's own numbers
                print(rank_line(run.rank, step, step_metrics), flush=True)
            if halt or (run.writer.nonfinite and cfg.train.nan_policy == "stop"):
                extras.stop_on_nonfinite(run, step, step_metrics)
            if due.checkpoint:
                with clock.aside("checkpoint"):
                    run.save(due.checkpoint)
            if due.sample:
                with clock.aside("sample"):  # rank 0 writes them; under FSDP every rank runs the model's forwards
                    if run.is_master or is_sharded(run.model):
                        write_samples(run, step)
            if stop:  # after its checkpoint: why the run stopped (run_end.py)
                from run_end import end_early
                end_early(run, stop)
                break
        if not stop:
            run.notifier.outcome = f"finished at step {state.step}"
        if state.nonfinite_skipped and run.is_master:
            print(f"warning: {state.nonfinite_skipped} step(s) were skipped for a non-finite loss or gradient "
                  f"(train.nan_policy=skip); see train/skipped_nonfinite_step in metrics.jsonl.", flush=True)
        recorder.wait()  # the last metrics, when they are written on a thread
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- one optimizer step


def train_step(model, optimizer, loader, grad_accum_steps, autocast, *, grad_clip, nan_policy="stop", objective=None,
               layer_norms=False):
    """One optimizer step over `grad_accum_steps` micro-batches of `loader`: forward, backward, clip, optimizer step.
    Returns ({metric: this rank's value, on the device}, seconds spent reading data); the recorder averages them over
    the ranks. In stage 2, `objective(model, x, y)` (Stages, below) replaces the model's own loss with CE + beta x KL.
    No host sync, unless nan_policy=skip (step_extras.py passes it)."""
    raw_model = model.module if isinstance(model, DDP) else model
    sharded = hasattr(model, "set_requires_gradient_sync")  # FSDP's fully_shard (fsdp.py)
    names = ["train/loss"] + (["train/ce_loss", "train/kl", "train/reference_loss"] if objective else [])
    sums = torch.zeros(len(names), device=loader.device)
    data_time = 0.0
    for micro_step in range(grad_accum_steps):
        data_start = time.perf_counter()
        x, y = loader.next_batch()
        data_time += time.perf_counter() - data_start
        # Gradients are all-reduced across ranks only on the last micro-step; syncing on every
        # micro-step would send the same amount of data grad_accum_steps times.
        last_micro_step = micro_step == grad_accum_steps - 1
        if sharded:  # FSDP's no_sync: reduce-scatter the gradients on the last micro-step only
            model.set_requires_gradient_sync(last_micro_step)
        with model.no_sync() if isinstance(model, DDP) and not last_micro_step else nullcontext(), autocast:
            parts = objective(model, x, y) if objective else [model(x, y)]
            loss = parts[0]
        # The loss is a mean over one micro-batch; dividing by the number of micro-steps makes the
        # summed gradients the mean over the whole batch, as if it were one big forward pass.
        (loss / grad_accum_steps).backward()
        sums += torch.stack([p.detach().float() for p in parts]) / grad_accum_steps
    step_metrics = dict(zip(names, sums))
    if layer_norms:  # before clipping, as train/grad_norm is (log.grad_norms_interval: step_extras.py asks)
        from lab.step_extras import per_layer_grad_norms
        step_metrics.update(per_layer_grad_norms(raw_model))
    # clip_grad_norm_ returns the norm before clipping; an infinite limit measures only.
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or float("inf"))
    if sharded:  # FSDP: the global norm of each rank's pieces, as a DTensor; the same number on every rank
        grad_norm = grad_norm.full_tensor()
    # nan_policy=skip must know now, which costs one host-device sync per step. Every rank decides alike: a rank's
    # non-finite loss makes its gradients non-finite, and the all-reduced gradient norm with them.
    if nan_policy == "skip" and not torch.isfinite(sums[0] + grad_norm).item():
        step_metrics = {"train/skipped_nonfinite_step": 1.0}
    else:
        optimizer.step()
        step_metrics["train/grad_norm"] = grad_norm
    optimizer.zero_grad(set_to_none=True)
    return step_metrics, data_time


def before_the_first_step(run):
    """Step 0's fixed evaluations and checkpoint (the ladder's start), and what a run with nothing left says."""
    plan, state = run.plan, run.state
    if state.step == 0 and not run.resumed:
        first = plan.due(0)  # something only where eval.fixed_steps or checkpoint.fixed_steps hold 0
        if first.evals:
            run.recorder.record_all(evaluate(run, first, run.stages.loaders[0][0]))
            for line in run.recorder.finish_step(0, collect=True, wait=True):
                print(line, flush=True)
        if first.checkpoint:
            run.save(first.checkpoint)
    if plan.end_step == 0 and not run.resumed:  # train.hard_stop=0: save what was loaded, as OLMo does
        if not (state.step == 0 and plan.due(0).checkpoint) and not plan.no_checkpoints:
            run.save("fixed")
        if run.is_master:
            saved = "nothing saved (train.no_checkpoints)" if plan.no_checkpoints else \
                f"step{state.step} in {run.cfg.train.out_dir} holds what was loaded"
            print(f"train.hard_stop=0: trained nothing; {saved}", flush=True)
    elif state.step >= plan.end_step and run.is_master:
        limit = f"train.hard_stop={run.cfg.train.hard_stop} stops it at step {plan.end_step}: raise it" \
            if plan.end_step < plan.max_steps else "raise train.max_steps"
        print(f"{run.cfg.train.out_dir} is already trained to step {state.step}; nothing to do ({limit} to train "
              f"longer).")
    if run.compiled and state.step < plan.end_step and run.is_master:
        print("torch.compile: the first step compiles the model first", flush=True)


# ----------------------------------------------------------------------------- evaluation and samples


@torch.no_grad()
def validation_loss(model, loader, steps, autocast):
    """Mean loss over the same `steps` val micro-batches every time, averaged over ranks (on device). The loop asks
    for val_steps x grad_accum_steps per rank: val_steps global batches, the same whatever the number of ranks."""
    model.eval()
    loader.load_state_dict({"position": 0})
    total = torch.zeros((), device=loader.device)
    for _ in range(steps):
        x, y = loader.next_batch()
        with autocast:
            loss = model(x, y)
        total += loss.float()
    model.train()
    total /= steps
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total


def evaluate(run, due, mix):
    """{metric: value}: with due.val the loss of each val set (`val/loss` is the current mixture's
    weighted mean when there are several); with due.tasks the downstream tasks' accuracies."""
    scores = {}
    if due.val:
        steps = run.cfg.eval.val_steps * run.plan.grad_accum_steps
        scores = {f"{prefix}/loss": validation_loss(run.model, loader, steps, run.autocast)
                  for prefix, loader in run.val_loaders.items()}
        if "val/loss" not in scores:  # several datasets: weighted by the current stage's mixture
            scores["val/loss"] = sum(share * scores[f"val/{name}/loss"] for name, share in mix)
    if due.tasks:  # the downstream tasks (hellaswag_eval.py)
        from hellaswag_eval import evaluate_in_loop
        scores.update(evaluate_in_loop(run))
    return scores


def write_samples(run, step):
    """Rank 0 writes them. Samples are optional output: a failure here is reported and training goes on. Under
    FSDP every rank runs the same forwards (each gathers weights from all), from rank 0's sampling generator."""
    from sample import generate_text
    e = run.cfg.eval
    if is_sharded(run.model):
        from lab.fsdp import share_generator
        share_generator(run.sample_generator)
    try:
        texts = generate_text(run.raw_model, e.sample_prompt, num_samples=e.num_samples, max_new_tokens=e.sample_tokens,
                              temperature=e.sample_temperature, top_k=e.sample_top_k, device=run.device,
                              generator=run.sample_generator, tokenizer=run.tokenizer)
        if not run.is_master:
            return
        with open(os.path.join(run.cfg.train.out_dir, "samples.txt"), "a") as f:
            for i, text in enumerate(texts):
                block = f"--- step {step}, sample {i}\n{text}\n"
                print(block, end="")
                f.write(block)
    except Exception as error:  # noqa: BLE001 - nothing in a sample is worth losing the run over
        print(f"warning: writing samples at step {step} failed ({type(error).__name__}: {error}); "
              f"training goes on.", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the run's parts


@dataclass
class Run:
    """What `build_run` made, for the loop to use: nothing here decides anything."""
    cfg: object
    rank: int
    world_size: int
    device: str
    is_master: bool  # rank 0 alone prints and writes files
    autocast: object  # bf16 autocast, or a no-op
    raw_model: GPT
    model: object  # raw_model, compiled and/or wrapped in DDP
    compiled: bool
    optimizer: torch.optim.Optimizer
    plan: Plan
    schedule: object
    stages: "Stages"  # the training data (and stage 2's objective) at each step
    val_loaders: dict
    task_examples: dict
    state: TrainState  # what the checkpoint saves for the trainer
    resumed: bool  # from this run's own checkpoint
    sample_generator: torch.Generator
    recorder: metrics.MetricRecorder
    writer: metrics.RowWriter
    checkpointer: Checkpointer
    stopper: Stopper
    extras: object  # step_extras.StepExtras: the step's optional parts, and the steps they run at
    flops_per_token: int
    peak_flops: float | None
    notifier: object  # notifier.Notifier: told how the run ended (log.slack_webhook)
    tokenizer: object  # the training data's: GPT-2's, or a character-level dataset's (the samples are written with it)

    def save(self, kind):
        """Snapshot the state after `state.step` (weights, optimizer, trainer state, RNG) and save it."""
        stall_start = time.perf_counter()
        self.checkpointer.wait()  # the previous async save first: at most one snapshot in CPU memory
        metrics.warn_if_slow("waiting for the previous checkpoint", time.perf_counter() - stall_start,
                             self.cfg.log.bookkeeping_soft_timeout)
        self.state.data = self.stages.loader_at(self.state.step).state_dict()  # where the next step reads
        trainer_state = {**self.state.to_dict(), "config": config_to_dict(self.cfg)}
        snapshot = capture_state(self.raw_model, self.optimizer, trainer_state, self.sample_generator, self.is_master,
                                 unsharded=Every(self.cfg.checkpoint.unsharded_interval).due(self.state.step))
        self.checkpointer.save(self.state.step, snapshot, kind, self.raw_model, self.optimizer)
        stalled = time.perf_counter() - stall_start
        if self.is_master and self.state.step > 0:
            how = "async" if self.cfg.checkpoint.async_save else "sync"
            print(f"checkpoint step{self.state.step} ({kind}, {how}): the loop stalled {stalled:.3f} s", flush=True)
            # The step's row is written before its checkpoint (a resume finds every row): the time comes after it.
            self.writer.late(self.state.step, {"throughput/checkpoint_time_sec": stalled})


def build_run(cfg, stack):
    """Set up everything the loop uses, part by part; `stack` closes what needs closing when the run ends.
    Every refusal comes first (decide_start): the run folder changes only once the start is loaded."""
    procs = start_processes(cfg)
    if cfg.train.data_parallel == "fsdp" and not dist.is_initialized():
        raise ConfigError("train.data_parallel=fsdp shards the model over torchrun's ranks, and this is a plain python "
                          "process; start it with torchrun --nproc-per-node=N, or set --train.data_parallel=ddp.")
    name = cfg.log.wandb_name or os.path.basename(os.path.abspath(cfg.train.out_dir))
    from lab.notifier import Notifier
    notifier = stack.enter_context(Notifier(cfg.log.slack_webhook, name, procs.is_master))  # a webhook, if any
    raw_model, init_record, auto_batch = build_model(cfg, procs)  # the same initial weights everywhere (FSDP: meta)
    start = run_dir.decide_start(cfg.train.out_dir, cfg.checkpoint, config_to_dict(cfg), raw_model, procs.rank,
                                 procs.world_size, procs.cpu_group, stack)  # lock, decide, refuse: writes nothing
    for name in dataset_names(cfg):  # rank 0 prepares a missing built-in dataset first; the others find it done
        rank0_first(lambda: prepare_on_first_use(dataset_dir(cfg.data.data_root, name)), procs.rank, procs.world_size)
    model, compiled = wrap_model(cfg, procs, raw_model, init_record, confirm_batch=auto_batch)  # (auto: on a GPU)
    stage_loaders, val_loaders = build_loaders(cfg, procs.rank, procs.world_size, procs.device)
    tokenizer = tokenizer_of(dataset_dir(cfg.data.data_root, stage_loaders[0][0][0][0]))
    task_examples = {}
    if cfg.eval.tasks:  # the downstream tasks' examples (hellaswag_eval.py)
        from hellaswag_eval import load_task_examples
        task_examples = load_task_examples(cfg, tokenizer, procs.rank, procs.world_size)
    optimizer = build_optimizer(raw_model, cfg.optim, procs.device_type)
    plan = make_plan(cfg, procs.world_size, stage_loaders[0][1].num_sequences * cfg.model.block_size,
                     raw_model.num_params(non_embedding=True))  # total_batch = micro-batch x ranks x accumulation
    schedule = build_schedule(cfg.optim, plan.max_steps)
    stages = Stages(stage_loaders, plan.stage2_step, cfg.stage2, raw_model, cfg.train.out_dir, procs.device)
    sample_generator = torch.Generator(procs.device).manual_seed(cfg.train.seed + procs.rank)
    state, replaced = load_start(cfg, procs, start, raw_model, optimizer, stages, sample_generator, plan)
    from stack_dump import register_stack_dump
    stack.callback(register_stack_dump(cfg.train.out_dir, procs.rank))  # `python debug.py stacks RUN`
    recorder, writer, checkpointer, stopper = beside_the_loop(cfg, procs, plan, replaced, start.replace_bucket, stack)
    from lab.step_extras import StepExtras
    extras = StepExtras(cfg, plan, state.step + 1, compiled, procs.is_master, stack)
    return Run(cfg=cfg, rank=procs.rank, world_size=procs.world_size, device=procs.device,
               is_master=procs.is_master, autocast=procs.autocast, raw_model=raw_model, model=model,
               compiled=compiled, optimizer=optimizer, plan=plan, schedule=schedule, stages=stages,
               val_loaders=val_loaders, task_examples=task_examples, state=state, resumed=start.resumed,
               sample_generator=sample_generator, recorder=recorder, writer=writer, checkpointer=checkpointer,
               stopper=stopper, extras=extras, notifier=notifier, tokenizer=tokenizer,
               flops_per_token=raw_model.flops_per_token(),  # once: it counts every parameter
               peak_flops=peak_flops_for_device(procs.device, cfg.train.peak_flops))


@dataclass
class Processes:
    """This process's place in the job, and the numbers it computes with."""
    rank: int
    world_size: int
    device: str
    device_type: str  # "cuda" or "cpu"
    cpu_group: object  # a gloo group for small host-side agreements (None: the default group)
    autocast: object  # bf16 autocast, or a context that does nothing
    is_master: bool  # rank 0 alone prints and writes the run folder's files


def start_processes(cfg):
    """Join the job and choose the numerics. Under torchrun: one process per GPU with NCCL, or gloo on CPU; a
    collective that waits train.dist_timeout seconds for a rank ends the run (collective_failure says so)."""
    if cfg.train.deterministic:
        from lab.debug import make_deterministic
        make_deterministic()  # before any CUDA work: cuBLAS reads its setting once
    choice = cfg.train.device
    want_cuda = choice.startswith("cuda") or (choice == "auto" and torch.cuda.is_available())
    rank, world_size, cpu_group = 0, 1, None
    if "RANK" not in os.environ:  # a plain `python train.py`
        device = ("cuda" if want_cuda else "cpu") if choice == "auto" else choice
    else:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        device = f"cuda:{local_rank}" if want_cuda else "cpu"
        if want_cuda:
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=cfg.train.dist_timeout)
        dist.init_process_group(backend="nccl" if want_cuda else "gloo", timeout=timeout)
        world_size = dist.get_world_size()
        # NCCL collectives run on the GPU stream; a gloo group lets ranks agree on CPU values (stop now?)
        # without waiting for the GPU. On CPU the default group is gloo already.
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if want_cuda else None
    device_type = torch.device(device).type
    use_bf16 = cfg.train.dtype == "bfloat16" or (
        cfg.train.dtype == "auto" and device_type == "cuda" and torch.cuda.is_bf16_supported())
    # bf16 autocast: matmuls in bfloat16, weights and optimizer state stay float32 (no loss scaling needed).
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # TF32 matmuls for the few float32 ones left
    return Processes(rank, world_size, device, device_type, cpu_group, autocast, is_master=rank == 0)


def collective_failure(error):
    """run_command's `also`: one sentence for a collective another rank made fail, else None (run_end.py words it)."""
    import run_end
    return run_end.collective_failure(error)


def prepare_on_first_use(path):
    """A built-in dataset not prepared yet is prepared now (prepare_data.py, imported then); another is an error."""
    if not shard_paths(path, "train"):
        from prepare_data import ensure_dataset
        ensure_dataset(path)


def build_model(cfg, procs):
    """(the GPT (train.model_module's class) with the same initial weights on every rank, on the device; the record
    of its initialisation or None). Under FSDP it is built on `meta` (shapes, no numbers) and its record is kept:
    wrap_model shards it, then each rank fills only its own pieces (fsdp.py), so no rank holds the whole model."""
    torch.manual_seed(cfg.train.seed)  # the same on every rank, so every replica starts identical
    loss_path = choose_loss_path(cfg.train.loss_path, procs.device_type, is_compiled(cfg, procs.device_type))
    make = functools.partial(gpt_class(cfg.train.model_module), cfg.model, loss_path)
    if cfg.train.data_parallel == "fsdp":  # on meta with its record, or whole where the record cannot replay it
        from lab.fsdp import build_for_fsdp
        raw_model, record = build_for_fsdp(make, procs.device, procs.is_master)
    else:
        raw_model, record = make().to(procs.device), None
    auto = cfg.data.batch_size == "auto"
    if auto:  # the largest micro-batch the estimate fits on this GPU (auto_batch.py)
        from lab.auto_batch import resolve_batch_size
        cfg.data.batch_size, why = resolve_batch_size(cfg, raw_model, procs.world_size, procs.device,
                                                      isinstance(procs.autocast, torch.autocast))
        if procs.is_master:
            print(why, flush=True)
    torch.manual_seed(cfg.train.seed + procs.rank)  # from here on each rank draws its own dropout masks
    if raw_model.config != cfg.model or len(raw_model.blocks) != cfg.model.n_layer:  # a model file that ignores it
        differs = [f"model.{f.name}={getattr(cfg.model, f.name)}, it built {getattr(raw_model.config, f.name, None)}"
                   for f in dataclasses.fields(cfg.model)
                   if getattr(raw_model.config, f.name, None) != getattr(cfg.model, f.name)]
        if len(raw_model.blocks) != cfg.model.n_layer and not any(d.startswith("model.n_layer=") for d in differs):
            differs.append(f"model.n_layer={cfg.model.n_layer}, it built {len(raw_model.blocks)} blocks")
        raise ConfigError(f"train.model_module={cfg.train.model_module}'s GPT was built from a config other than the "
                          f"run's model section ({'; '.join(differs)}); build the model from the GPTConfig it is "
                          f"given, so that its checkpoints load again.")
    return raw_model, record, auto


def wrap_model(cfg, procs, raw_model, init_record=None, confirm_batch=False):
    """(model, compiled): the form the loop calls, compiled and/or wrapped in DDP (which all-reduces the gradients);
    the raw model keeps the weights, which the optimizer and the checkpoints use. Under FSDP the model is sharded in
    place (fsdp.py), both forms at once."""
    compiled = is_compiled(cfg, procs.device_type)
    if cfg.train.data_parallel == "fsdp":  # sharded in place: raw_model becomes the form the loop calls too
        from lab.fsdp import shard_and_fill
        shard_and_fill(raw_model, init_record, cfg.train.seed, procs, compiled)
    if confirm_batch:  # data.batch_size=auto: one trial step of the chosen micro-batch (auto_batch.py)
        from lab.auto_batch import confirm_batch_size
        confirm_batch_size(cfg, procs, raw_model)
    if cfg.train.data_parallel == "fsdp":
        return raw_model, compiled
    model = torch.compile(raw_model) if compiled else raw_model
    if procs.world_size > 1:
        model = DDP(model, device_ids=[procs.device] if procs.device_type == "cuda" else None)
    return model, compiled


class Stages:
    """The training data in use at each step and, from stage 2's first step on, stage 2's objective: the one place
    that crosses into stage 2 (stage2.py, imported then), whether the run gets there or resumes inside it. `loaders`
    are [(mixture, loader)] of stage 1 and, with stage2.mix, stage 2; `stage2_step` is the number of steps completed
    when stage 2 begins (None: one stage)."""

    def __init__(self, loaders, stage2_step, stage2_cfg, raw_model, out_dir, device):
        self.loaders, self.stage2_step, self.cfg = loaders, stage2_step, stage2_cfg
        self.raw_model, self.out_dir, self.device = raw_model, out_dir, device
        self.objective = None
        self.resumed_inside = False  # set by resume_at: the reference comes back from the boundary checkpoint

    def resume_at(self, steps_completed, data_state):
        """A resumed run: the data position goes to the loader that saved it."""
        self.loader_at(steps_completed).load_state_dict(data_state)
        self.resumed_inside = self.stage2_step is not None and steps_completed > self.stage2_step

    def loader_at(self, step):
        """The loader step `step` (0: none yet) read from."""
        return self.loaders[-1 if self.stage2_step is not None and step > self.stage2_step else 0][1]

    def at(self, step):
        """(mixture, loader, objective) for step `step` (1-based, the step being taken); the objective is None in
        stage 1 (the model's own loss), else stage 2's (stage2.begin_stage2)."""
        if self.stage2_step is None or step <= self.stage2_step:
            return (*self.loaders[0], None)
        if self.objective is None:  # the first step of stage 2 in this process
            from lab.stage2 import begin_stage2
            self.objective = begin_stage2(self)
        return (*self.loaders[-1], self.objective)


def load_start(cfg, procs, start, raw_model, optimizer, stages, sample_generator, plan):
    """Load the checkpoint the run starts from (the optimizer keeps this config's settings), carry out the
    rest of the start in the run folder (run_dir.carry_out_start), and say where the run starts.
    Returns (TrainState, the checkpoint folders of a run this one replaces, deleted after our first save)."""
    ck, out_dir = cfg.checkpoint, cfg.train.out_dir
    state = TrainState(best_val_loss=torch.tensor(float("inf"), device=procs.device),
                       data=stages.loaders[0][1].state_dict())
    names = [name for loaders in stages.loaders for name, _ in loaders[0]]
    fingerprints = {name: fingerprint(dataset_dir(cfg.data.data_root, name)) for name in dict.fromkeys(names)}
    load_optim = start.resumed or ck.load_optim
    saved = load_checkpoint(start.path, model=raw_model, optimizer=optimizer, sample_generator=sample_generator,
                            rank=procs.rank, world_size=procs.world_size, load_optim=load_optim,
                            load_trainer_state=start.resumed or ck.load_trainer_state) if start.path else None
    if saved:
        state = TrainState.from_dict(saved)
        state.best_val_loss = state.best_val_loss.to(procs.device)
        stages.resume_at(state.step, state.data)  # the data position is global: any world size works
        check_start_step(cfg, start, state, plan, fingerprints)
    state.data_fingerprint, state.model_code = fingerprints, model_code(cfg.train.model_module)
    replaced = []
    if procs.world_size > 1:
        dist.barrier()  # every rank has read the start before rank 0 moves files into place
    if procs.is_master:
        replaced, lines = run_dir.carry_out_start(out_dir, start, saved["config"] if start.resumed else None,
                                                  config_to_dict(cfg), state.step, ck,
                                                  trains=state.step < plan.end_step or not start.resumed)
        save_environment(out_dir, procs.world_size)
        print(describe_run(cfg, raw_model, plan, world_size=procs.world_size, device=procs.device,
                           sequences_per_epoch=stages.loaders[0][1].num_sequences))
        mixes = "; ".join([f"data: {shares_text(stages.loaders[0][0])}"] + [
            f"stage 2 after step {plan.stage2_step}: {shares_text(stages.loaders[-1][0])}"] * bool(plan.stage2_step))
        benchmark = "note: train.no_checkpoints: this run loads no checkpoint and saves none" * cfg.train.no_checkpoints
        for line in filter(None, [benchmark, started_from(start, saved, load_optim, state.step),
                                  mixes if cfg.data.mix or cfg.stage2.start else "", *start.notes, *lines]):
            print(line)
    if procs.world_size > 1:
        dist.barrier()  # the folder is ready before any rank writes or checks for a CANCEL file
    return state, replaced


def check_start_step(cfg, start, state, plan, fingerprints):
    """Before the run folder changes: a resume must read the data it trained on (the same content, whatever
    data.data_root now says), and a start from another run's trainer state must leave steps to train."""
    changed = [name for name, print_ in fingerprints.items() if state.data_fingerprint.get(name, print_) != print_]
    if start.resumed and changed:
        raise CheckpointError(f"the dataset {changed[0]} under data.data_root={cfg.data.data_root or '(data/)'} is not "
                              f"the one this run trained on (its content differs); point data.data_root at the run's "
                              f"data, or train on this data in a new train.out_dir.")
    if not start.resumed and state.step >= plan.end_step > 0:  # (hard_stop=0: save what was loaded, train nothing)
        raise CheckpointError(f"checkpoint.load_path={start.path} is at step {state.step}, and this run ends at step "
                              f"{plan.end_step}, so nothing would train; raise train.max_steps, or pass "
                              f"--checkpoint.load_trainer_state=false to train from its weights from step 0.")


def started_from(start, saved, load_optim, step):
    """What was loaded: this run's own checkpoint (a resume), what checkpoint.load_path gave, or nothing ("")."""
    if start.resumed:
        return f"resumed from {start.path} at step {step}"
    if not start.path:
        return ""
    ours = os.path.exists(os.path.join(start.path, MARKER))  # else GPT-2's weights, with a fresh optimizer
    loaded = ["weights"] + ["optimizer state"] * (ours and load_optim) + ["trainer state"] * (saved is not None)
    return f"loaded {', '.join(loaded)} from {start.path}; the run starts at step {step}"


def beside_the_loop(cfg, procs, plan, replaced, replaced_in_bucket, stack):
    """What runs beside the loop: the metric recorder and its writer, the checkpointer (and its uploads) and the
    stopper. `replaced` / `replaced_in_bucket`: another run's checkpoints this one replaces (save_overwrite)."""
    out_dir = cfg.train.out_dir
    sinks = stack.enter_context(metrics.Sinks(out_dir, cfg.log, config_to_dict(cfg))) if procs.is_master else None
    writer = metrics.RowWriter(sinks, LossSpikeDetector(cfg.train.loss_spike_threshold), cfg.log.interval,
                               plan.end_step, prints=async_bookkeeping(cfg, procs))
    # Async bookkeeping gets a gloo group of its own: its collectives run on another thread.
    async_group = dist.new_group(backend="gloo") if async_bookkeeping(cfg, procs) and procs.world_size > 1 else None
    recorder = metrics.MetricRecorder(procs.device, procs.world_size, async_bookkeeping(cfg, procs), async_group,
                                      on_rows=writer, soft_timeout=cfg.log.bookkeeping_soft_timeout)
    stack.callback(recorder.close)
    uploader = None
    if cfg.checkpoint.remote_folder and procs.is_master:  # uploads on a thread of their own (remote.py)
        from lab import remote
        uploader = remote.start_uploads(cfg.checkpoint, lambda: run_dir.run_records(out_dir), replaced_in_bucket,
                                        writer, stack)  # closed via `stack` after checkpointer.wait: last save goes up
    # FSDP: every rank writes its pieces of each checkpoint, through a gloo group of the checkpoints' own.
    shard_group = dist.new_group(backend="gloo") if cfg.train.data_parallel == "fsdp" else None
    checkpointer = Checkpointer(out_dir, cfg.checkpoint.keep_last, cfg.checkpoint.async_save, procs.is_master,
                                replaced=replaced, uploader=uploader, shard_group=shard_group)
    stack.callback(checkpointer.wait)  # a save still in flight must land before the process exits
    stopper = Stopper(stack.enter_context(SignalFlag()), out_dir, cfg.train.time_limit,
                      cfg.train.cancel_check_interval, procs.is_master, sinks, procs.cpu_group)
    return recorder, writer, checkpointer, stopper


def async_bookkeeping(cfg, procs):
    """log.async_bookkeeping resolved: auto is on where a gloo group exists, that is with more than one rank."""
    return cfg.log.async_bookkeeping == "true" or (cfg.log.async_bookkeeping == "auto" and procs.world_size > 1)


if __name__ == "__main__":
    run_command(main, sys.argv[1:], also=collective_failure)
