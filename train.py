"""Train a GPT. This file is the table of contents of the trainer: read it top to bottom.

    python train.py                                       # Shakespeare on a laptop CPU
    python train.py config/gpt2.py --train.hard_stop=100  # a config file, with overrides
    python train.py config/gpt2.py --dry_run              # print the plan; touch nothing
    torchrun --nproc-per-node=8 train.py config/gpt2.py   # GPT-2 (124M), 8 GPUs

`main` checks the config; `train` is the loop, and `train_step`, right below it, one optimizer step.
Then evaluation, samples and checkpoints, and `build_run`, which sets the run up part by part. The
optional features live in lab/, each imported on the line that tests its setting.
"""

import datetime
import functools
import gc
import os
import re
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import metrics
import run_dir
from checkpoint import Checkpointer, TrainState, gpt_class
from checkpoint_folder import newest_checkpoint
from config import ConfigError, UserError, check_warmup, config_to_dict, parse_args, run_command
from data import build_loaders, dataset_dir, dataset_names, get_tokenizer, rank0_first, shard_paths
from devices import DeviceKind, device_kind, pick_device
from metrics import NonFiniteLoss, StepClock
from model import GPT, choose_fast_loss, fast_loss_problem, loss_slice_rows
from optimizer import build_optimizer, build_schedule, set_lr
from plan import (PLAIN_STEP, Plan, SignalFlag, Stopper, check_weights_fit_device, describe_run,
                  is_compiled, loss_path_on, make_plan)


# ------------------------------------------------------------------------------- the command line

TORCH_FLOOR = (2, 9)  # Muon's adjust_lr_fn="match_rms_adamw" came in torch 2.9 (requirements.txt)


def check_torch(version):
    """One sentence if `version` (torch.__version__) is older than TORCH_FLOOR."""
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    if found < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise UserError(f"this is torch {version}, and the trainer needs torch {floor} or newer "
                        f"(torch.optim.Muon); pip install 'torch>={floor}'.")



def main(argv):
    """Every mistake a user can make in the config fails here, in one sentence, before any file is
    touched."""
    check_torch(torch.__version__)
    args = [a for a in argv if a != "--dry_run"]
    cfg = parse_args(args)
    if cfg.eval.tasks:
        from hellaswag_eval import check_names
        check_names(cfg.eval.tasks, "eval.tasks")
    for name in [cfg.data.dataset, *cfg.eval.extra_datasets, *dataset_names(cfg)]:
        dataset_dir(cfg.data.data_root, name)  # a name that leaves the data root: before any lock
    try:
        gpt_class(cfg.train.model_module)  # a model file without a GPT, or without what is asked
    except ValueError as error:
        raise ConfigError(str(error)) from None
    processes = int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1
    pick_device(cfg.train.device, "--train.device", processes)  # a device this torch does not see
    if not cfg.train.max_duration:  # (a duration in tokens or epochs: make_plan, once data is read)
        check_warmup(cfg.optim.warmup_steps, cfg.train.max_steps)
    if cfg.train.no_checkpoints:  # a benchmark: nothing is loaded or saved
        ck = cfg.checkpoint
        ck.load, ck.load_path, ck.remote_folder = "never", "", ""
    if cfg.checkpoint.remote_folder:  # credentials, bucket, endpoint: now, not at the first upload
        from lab import remote
        remote.check(cfg.checkpoint.remote_folder, cfg.train.out_dir)
    if cfg.checkpoint.load_path:  # a GPT-2's shape, or one sentence for a typo
        run_dir.use_load_path_shape(cfg, default_config=not args or args[0].startswith("--"))
    if cfg.stage2.reference:  # needed when stage 2 begins, hours from now: checked now
        from lab.stage2 import check_reference
        check_reference(cfg.stage2.reference, cfg.model, cfg.stage2.kl_estimator,
                        cfg.train.model_module)
    if "--dry_run" in argv:
        from lab.dry_run import dry_run
        return dry_run(cfg)
    train(cfg)


# --------------------------------------------------------------------------------------- the loop


def train(cfg):
    """Train the run `cfg` describes (ladder.py calls this too, with a config it built)."""
    with ExitStack() as stack:
        run = build_run(cfg, stack)
        plan, state, books, place = run.plan, run.state, run.books, run.place
        before_the_first_step(run)
        clock = StepClock(place.kind.synchronize, plan.tokens_per_step, cfg.model.block_size,
                          run.flops_per_token, place.world_size, run.peak_flops)
        mix, loader, objective = run.data.stages.for_step(state.step + 1)
        stop = ""
        nonfinite = ""  # a NaN or Inf in the metrics, or too many steps skipped: the run ends on it
        while state.step < plan.end_step:
            step = state.step + 1  # the step being taken, as logged
            if step - 1 == plan.stage2_step:  # stage 2 begins: its data and objective
                mix, loader, objective = run.data.stages.for_step(step)
            lrs = set_lr(run.optimizer, run.schedule.lr_at(step), cfg.optim.lr)
            extras = run.extras if step in run.extras_steps else None  # (lab/step_extras.py)
            options = extras.before_step(run, step, loader, clock) if extras else PLAIN_STEP
            step_metrics, data_time = train_step(run.model, run.optimizer, loader,
                                                 plan.grad_accum_steps, place.autocast,
                                                 cfg.optim.grad_clip, objective, options)
            if extras:  # (too many non-finite steps skipped in a row: the run ends on it)
                nonfinite = extras.after_step(run, step, step_metrics, clock) or nonfinite
            trained = "train/loss" in step_metrics  # a skipped step trained nothing
            state.step = step
            if trained:
                state.tokens += plan.tokens_per_step
            speed, apart = clock.lap(state.tokens, data_time, trained)

            # After the step, in this order: stop?, evaluate, metrics, checkpoint, samples. On a
            # stop (a scheduler's grace period is short) only the checkpoint runs.
            stop = books.stopper.poll(step)  # a signal, CANCEL, the time limit: all ranks agree
            due = plan.due(step, last=step == plan.end_step, stop=bool(stop))
            values = {**step_metrics, **speed, **lrs, "tokens": state.tokens}  # means over ranks
            maxima = dict(apart)  # the time every rank waited for: the slowest rank's
            if due.evals:
                with clock.paused("eval"):
                    values.update(evaluate(run, due, mix))
                if "val/loss" in values:  # (a device tensor: no sync)
                    state.best_val_loss = torch.minimum(state.best_val_loss, values["val/loss"])
            if due.write_metrics:  # the data's position; memory and uploads: the largest rank's
                values.update(loader.metrics())
                maxima.update(place.kind.memory(place.device))
                if cfg.checkpoint.remote_folder:
                    maxima.update(books.checkpointer.upload_metrics())
            # The rows written come back as the console lines to print, with the first NaN or Inf
            # in train/loss or grad_norm among them. Before a checkpoint every row so far is
            # written, and a non-finite value among them ends the run (train.nan_policy).
            halt = bool(nonfinite)  # (the rows so far are written before the run ends)
            lines, found = books.recorder.finish_step(step, values, due.write_metrics or halt,
                                                      wait=bool(due.checkpoint) or halt,
                                                      maxima=maxima)
            for line in lines:
                print(line, flush=True)
            nonfinite = nonfinite or found
            if nonfinite:
                raise NonFiniteLoss(nonfinite_advice(nonfinite, cfg.train.out_dir,
                                                     skipping=cfg.train.nan_policy == "skip"))
            if due.checkpoint:  # (its time goes in its own step's row, the last one's too)
                with clock.paused("checkpoint", logged=False):
                    state.data = loader.state_dict()  # where the next step reads
                    seconds = books.checkpointer.save(step, due.checkpoint, run.raw_model,
                                                      run.optimizer, state, run.sample_generator)
                books.writer.write([(step, {"throughput/checkpoint_time_sec": seconds})])
            if due.sample:
                with clock.paused("sample"):
                    write_samples(run, step)
            if due.collect_garbage:  # OLMo's GarbageCollector: every rank at the same step
                gc.collect(1)
            if stop:
                books.checkpointer.wait()  # the checkpoint has landed before the run says so
                outcome = books.stopper.stopped(stop, step, saved=not plan.no_checkpoints)
                break
        else:
            outcome = f"finished at step {state.step}"
        if books.notifier:
            books.notifier.outcome = outcome
        if state.nonfinite_skipped and place.is_master:
            print(f"warning: {state.nonfinite_skipped} step(s) were skipped for a non-finite loss "
                  "or gradient (train.nan_policy=skip); see train/skipped_nonfinite_step in "
                  "metrics.jsonl.", flush=True)
        books.recorder.wait()  # the last metrics, when they are written on a thread
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- one optimizer step


def train_step(model, optimizer, loader, grad_accum_steps, autocast, grad_clip, objective=None,
               options=PLAIN_STEP):
    """One optimizer step over `grad_accum_steps` micro-batches of `loader`: forward, backward,
    clip, optimizer step. Returns ({metric: this rank's value, on the device}, seconds reading
    data); the recorder averages them over the ranks. In stage 2 `objective(model, x, y)` replaces
    the model's loss with CE + beta x KL (lab/stage2.py). `options` (plan.StepOptions): what
    lab/step_extras.py asks of this step. No host sync, unless nan_policy=skip."""
    if options.skip_data:  # train.steps_to_skip: read past a known-bad stretch of data, untrained
        loader.skip_batches(grad_accum_steps)
        return {"train/skipped_data_step": 1.0}, 0.0
    raw_model = model.module if isinstance(model, DDP) else model
    sharded = hasattr(model, "set_requires_gradient_sync")  # FSDP (lab/fsdp.py)
    names = ["train/loss"]
    if objective:  # stage 2's parts of the loss
        names += ["train/ce_loss", "train/kl", "train/reference_loss"]
    sums = torch.zeros(len(names), device=loader.device)
    data_time = 0.0
    for micro_step in range(grad_accum_steps):
        data_start = time.perf_counter()
        x, y = loader.next_batch()
        data_time += time.perf_counter() - data_start
        # Gradients are all-reduced across ranks on the last micro-step only; syncing on every
        # micro-step would send the same amount of data grad_accum_steps times.
        last_micro_step = micro_step == grad_accum_steps - 1
        if sharded:  # FSDP's no_sync: reduce-scatter on the last micro-step only
            model.set_requires_gradient_sync(last_micro_step)
        no_sync = isinstance(model, DDP) and not last_micro_step
        with model.no_sync() if no_sync else nullcontext(), autocast:
            parts = objective(model, x, y) if objective else [model(x, y)]
        # The loss is a mean over one micro-batch; dividing by the number of micro-steps makes the
        # summed gradients the mean over the whole batch, as if it were one big forward pass.
        (parts[0] / grad_accum_steps).backward()
        sums += torch.stack([p.detach().float() for p in parts]) / grad_accum_steps
    step_metrics = dict(zip(names, sums))
    if options.layer_norms:  # before clipping, as train/grad_norm (log.grad_norms_interval)
        from lab.step_extras import per_layer_grad_norms
        step_metrics.update(per_layer_grad_norms(raw_model))
    # clip_grad_norm_ returns the norm before clipping; an infinite limit measures only.
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or float("inf"))
    if sharded:  # a DTensor under FSDP: the global norm, the same number on every rank
        grad_norm = grad_norm.full_tensor()
    # nan_policy=skip must know now: one host-device sync per step. Every rank decides alike: a
    # rank's non-finite loss makes its gradients, and the all-reduced norm, non-finite.
    if options.nan_policy == "skip" and not torch.isfinite(sums[0] + grad_norm).item():
        step_metrics = {"train/skipped_nonfinite_step": 1.0}
    else:
        optimizer.step()
        step_metrics["train/grad_norm"] = grad_norm
    # Every parameter the optimizer steps is the model's: dropping the gradients there is
    # optimizer.zero_grad(set_to_none=True).
    raw_model.zero_grad(set_to_none=True)
    return step_metrics, data_time


def nonfinite_advice(what, out_dir, skipping=False):
    """The sentence that ends a run on `what` (what went non-finite, and where), with the way on:
    resume from its last checkpoint, or start again if it has none. `skipping`: it ended under
    train.nan_policy=skip, whose limit is the knob; else the offer is nan_policy=skip."""
    last = newest_checkpoint(out_dir)
    restart = (f"resume from its last checkpoint, {os.path.basename(last)}," if last else
               "start again (the run has no checkpoint to resume)")
    then = (" (train.nan_skip_limit sets how many in a row)" if skipping else
            ", or set train.nan_policy=skip to skip such steps")
    return f"{what}; {restart} with a lower optim.lr{then}."


def save_first(run, kind, loader):
    """A checkpoint before the loop's first step: step 0's fixed one, or train.hard_stop=0's."""
    run.state.data = loader.state_dict()
    run.books.checkpointer.save(run.state.step, kind, run.raw_model, run.optimizer, run.state,
                                run.sample_generator)


def before_the_first_step(run):
    """Step 0's fixed evaluations and checkpoint (the ladder's start), and what a run with nothing
    left to train says."""
    plan, state, cfg = run.plan, run.state, run.cfg
    first_loader = run.data.stages.loaders[0][1]
    if state.step == 0 and not run.resumed:
        # something only where eval.fixed_steps or checkpoint.fixed_steps hold 0
        first = plan.due(0)
        if first.evals:
            run.books.recorder.record_all(evaluate(run, first, run.data.stages.loaders[0][0]))
            lines, _ = run.books.recorder.finish_step(0, {}, write=True, wait=True)
            for line in lines:  # (no training yet: no loss to be non-finite)
                print(line, flush=True)
        if first.checkpoint:
            save_first(run, first.checkpoint, first_loader)
    if plan.end_step == 0 and not run.resumed:  # train.hard_stop=0: save what was loaded (OLMo)
        if not (state.step == 0 and plan.due(0).checkpoint) and not plan.no_checkpoints:
            save_first(run, "fixed", first_loader)
        if run.place.is_master:
            saved = "nothing saved (train.no_checkpoints)" if plan.no_checkpoints else \
                f"step{state.step} in {cfg.train.out_dir} holds what was loaded"
            print(f"train.hard_stop=0: trained nothing; {saved}", flush=True)
    elif state.step >= plan.end_step and run.place.is_master:
        limit = (f"train.hard_stop={cfg.train.hard_stop} stops it at step {plan.end_step}: raise it"
                 if plan.end_step < plan.max_steps else "raise train.max_steps")
        print(f"{cfg.train.out_dir} is already trained to step {state.step}; nothing to do "
              f"({limit} to train longer).")
    if run.compiled and state.step < plan.end_step and run.place.is_master:
        print("torch.compile: the first step compiles the model first", flush=True)


# ------------------------------------------------------------------------- evaluation and samples


@torch.no_grad()
def evaluate(run, due, mix):
    """{metric: value}: with due.val the loss of each val set over the same batches every time,
    averaged over the ranks (`val/loss` is the current mixture's weighted mean when there are
    several); with due.tasks the downstream tasks' accuracies (hellaswag_eval.py)."""
    scores, model, place = {}, run.model, run.place
    if due.val:
        batches = run.cfg.eval.val_steps * run.plan.grad_accum_steps  # val_steps global batches
        model.eval()
        for prefix, loader in run.data.val_loaders.items():
            loader.position = 0
            total = torch.zeros((), device=loader.device)
            for _ in range(batches):
                x, y = loader.next_batch()
                with place.autocast:
                    total += model(x, y).float()
            if place.world_size > 1:
                dist.all_reduce(total, op=dist.ReduceOp.AVG)
            scores[f"{prefix}/loss"] = total / batches
        model.train()
        if "val/loss" not in scores:  # several datasets: weighted by the current stage's mixture
            scores["val/loss"] = sum(share * scores[f"val/{name}/loss"] for name, share in mix)
    if due.tasks and not run.data.fast_paths.get("tasks"):  # (off once a check found otherwise)
        from hellaswag_eval import evaluate_in_loop, scoring_problem
        check_fast_path(run, "tasks", scoring_problem)  # each time: the weights have trained since
        if not run.data.fast_paths["tasks"]:
            scores.update(evaluate_in_loop(run.raw_model, run.data.task_examples, place,
                                           run.cfg.eval.tasks_batch_size))
    check_fast_loss(run)  # (back in training mode)
    return scores


def check_fast_loss(run):
    """At each evaluation, in training mode: the faster loss the run chose at start still gives
    forward's loss on the first micro-batch (the loss alone, one forward each way). Where it stops,
    the run says so in one line and goes on with forward's own line."""
    model, place = run.raw_model, run.place
    if not getattr(model, "fast_loss", ""):
        return
    with place.autocast:
        problem = fast_loss_problem(model, *run.first_batch, model.fast_loss, gradients=False)
    if all_ranks_agree(place, not problem):
        return
    if place.is_master:
        problem = problem or "on another rank the loss path chosen at start gives another loss"
        print(f"warning: at step {run.state.step}, {problem} on the first micro-batch; forward's "
              f"own line computes the loss from step {run.state.step + 1} on.", file=sys.stderr,
              flush=True)
    model.fast_loss = ""


def check_fast_path(run, what, problem_of):
    """Each time before the loop samples or scores the tasks (`what`): `problem_of` compares the
    fast path they take (the KV cache, score_tokens) with the model's plain forward, to float noise
    (a few short rows: cheap next to what follows). A difference is a warning, and turns `what` off
    for the rest of the run; the ranks that take the path agree."""
    place, sharded = run.place, run.place.sharding is not None
    bf16 = sharded and isinstance(place.autocast, torch.autocast)  # FSDP's bf16 weights
    problem = problem_of(run.raw_model, **({"tolerance": 2e-2} if bf16 else {}))
    if place.world_size > 1 and (sharded or what == "tasks"):
        found = torch.tensor([float(bool(problem))], device=place.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        problem = problem or ("another rank found its fast path other than the plain forward."
                              if found.item() else "")
    run.data.fast_paths[what] = problem
    if problem and place.is_master:
        print(f"warning: at step {run.state.step}, {problem[:-1]}; {what} are off for this run.",
              file=sys.stderr, flush=True)


def write_samples(run, step):
    """Rank 0 writes them to samples.txt and the console. Samples are optional output: a failure is
    reported and training goes on. Under FSDP every rank runs the same forwards (each gathers
    weights from all), from rank 0's sampling generator."""
    from sample import generate_text
    e, place = run.cfg.eval, run.place
    if not (place.is_master or place.sharding):
        return
    if place.sharding:
        from lab.fsdp import share_generator
        share_generator(run.sample_generator)
    try:
        if run.data.fast_paths.get("samples"):  # off once a check found otherwise
            return
        from sample import kv_cache_problem
        check_fast_path(run, "samples", kv_cache_problem)  # each time: the weights have trained
        if run.data.fast_paths["samples"]:
            return
        texts = generate_text(run.raw_model, e.sample_prompt, num_samples=e.num_samples,
                              max_new_tokens=e.sample_tokens, temperature=e.sample_temperature,
                              top_k=e.sample_top_k, device=place.device,
                              generator=run.sample_generator, tokenizer=run.data.tokenizer)
        if not place.is_master:
            return
        with open(os.path.join(run.cfg.train.out_dir, "samples.txt"), "a") as f:
            for i, text in enumerate(texts):
                block = f"--- step {step}, sample {i}\n{text}\n"
                print(block, end="")
                f.write(block)
    except Exception as error:  # noqa: BLE001 - nothing in a sample is worth losing the run over
        print(f"warning: writing samples at step {step} failed ({type(error).__name__}: {error}); "
              f"training goes on.", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------- the run's parts


@dataclass
class Placement:
    """This process's place in the job, and the numbers it computes with."""
    rank: int
    world_size: int
    device: str
    device_type: str  # "cuda", "mps" or "cpu"
    kind: DeviceKind  # its row of the device table (devices.py)
    cpu_group: object  # a gloo group for small host-side agreements (None: the default group)
    autocast: object  # bf16 autocast, or a context that does nothing
    is_master: bool  # rank 0 alone prints and writes the run folder's files
    # train.data_parallel=fsdp: lab/fsdp.py's ShardedCheckpoints (each rank holds pieces); else None
    sharding: object = None


@dataclass
class RunData:
    """What the run reads: its training data at each step, its val sets, its tasks, its tokenizer.
    """
    stages: "Stages"
    val_loaders: dict  # {metric prefix: TokenLoader}
    task_examples: dict  # eval.tasks' examples (hellaswag_eval.py)
    tokenizer: object  # the training data's: GPT-2's, or a character-level dataset's
    # "samples", "tasks" once checked (check_fast_path): "" or why the loop runs them no more
    fast_paths: dict = field(default_factory=dict)


@dataclass
class Books:
    """What runs beside the loop: metrics, checkpoints, the stop signals, the webhook."""
    recorder: metrics.MetricRecorder
    writer: metrics.RowWriter
    checkpointer: Checkpointer
    stopper: Stopper
    notifier: object  # lab/notifier.py's Notifier, or None without a webhook


@dataclass
class Run:
    """What `build_run` made, for the loop to use: nothing here decides anything."""
    cfg: object
    place: Placement
    raw_model: GPT
    model: object  # raw_model, compiled and/or wrapped in DDP
    compiled: bool
    optimizer: torch.optim.Optimizer
    schedule: object
    plan: Plan
    data: RunData
    books: Books
    state: TrainState  # what the checkpoint saves for the trainer
    resumed: bool  # from this run's own checkpoint
    sample_generator: torch.Generator
    extras: object  # lab/step_extras.py's StepExtras, or None
    extras_steps: object  # the steps it has work at (a set or range; empty without extras)
    first_batch: tuple  # (x, y) the first step reads: the loss path is checked on it (evaluate)
    flops_per_token: int
    peak_flops: float | None


def build_run(cfg, stack):
    """Set up everything the loop uses, part by part; `stack` closes what needs closing when the
    run ends. Every refusal comes first (decide_start): the run folder changes only once the start
    is loaded."""
    place = start_processes(cfg)
    if cfg.train.gc_interval:  # OLMo's GarbageCollector: no pause at a moment every rank waits for
        gc.disable()
        stack.callback(gc.enable)
    notifier = None
    if cfg.log.slack_webhook or os.environ.get("SLACK_WEBHOOK_URL"):  # (lab/notifier.py)
        from lab.notifier import Notifier
        name = cfg.log.wandb_name or os.path.basename(os.path.abspath(cfg.train.out_dir))
        notifier = stack.enter_context(Notifier(cfg.log.slack_webhook, name, place.is_master))
    raw_model, init_record, auto_batch = build_model(cfg, place)  # FSDP: on meta
    start = run_dir.decide_start(cfg.train.out_dir, cfg.checkpoint, config_to_dict(cfg), raw_model,
                                 place, stack)  # lock, decide, refuse: writes nothing
    for name in dataset_names(cfg):  # rank 0 prepares a missing built-in dataset
        rank0_first(lambda: prepare_on_first_use(dataset_dir(cfg.data.data_root, name)),
                    place.rank, place.world_size)
    model, compiled = wrap_model(cfg, place, raw_model, init_record, confirm_batch=auto_batch)
    config_dict = config_to_dict(cfg)  # (after data.batch_size=auto is resolved)
    stage_loaders, val_loaders = build_loaders(cfg, place.rank, place.world_size, place.device,
                                               place.kind.pin_memory)
    tokenizer = get_tokenizer(dataset_dir(cfg.data.data_root, stage_loaders[0][0][0][0]))
    task_examples = {}
    if cfg.eval.tasks:
        from hellaswag_eval import load_task_examples
        task_examples = load_task_examples(cfg, tokenizer, place.rank, place.world_size)
    optimizer = build_optimizer(raw_model, cfg.optim, place.kind.fused_optimizer)
    tokens_per_epoch = stage_loaders[0][1].num_sequences * cfg.model.block_size
    non_embedding = raw_model.num_params(non_embedding=True)
    plan = make_plan(cfg, place.world_size, tokens_per_epoch, non_embedding)
    stages = Stages(stage_loaders, plan.stage2_step, cfg.stage2, raw_model, cfg.train.out_dir,
                    place.device, cfg.train.model_module)
    generator = torch.Generator(place.device).manual_seed(cfg.train.seed + place.rank)
    wandb_run = start_wandb(cfg, place, start, config_dict)  # (or refused: the folder as it was)
    state, replaced = run_dir.load_start(cfg, place, start, raw_model, optimizer, stages, generator,
                                         plan, config_dict)
    first_loader = stages.loader_at(state.step + 1)  # the loader of the step the run takes first
    first_batch, loss_why = decide_fast_loss(cfg, place, raw_model, first_loader, compiled)
    if place.is_master:
        print(describe_run(cfg, raw_model, plan, world_size=place.world_size, device=place.device,
                           sequences_per_epoch=stages.loaders[0][1].num_sequences,
                           compiled=compiled, loss_why=loss_why))
    stack.callback(run_dir.register_stack_dump(cfg.train.out_dir, place.rank))
    books = start_bookkeeping(cfg, place, plan, replaced, start.replace_bucket, config_dict, stack,
                              wandb_run)
    books.notifier = notifier
    extras, extras_steps = None, ()
    if needs_step_extras(cfg, plan, compiled):
        from lab.step_extras import StepExtras
        extras = StepExtras(cfg, plan, state.step + 1, compiled, place.is_master, stack)
        extras_steps = extras.steps
    return Run(cfg=cfg, place=place, raw_model=raw_model, model=model, compiled=compiled,
               optimizer=optimizer, schedule=build_schedule(cfg.optim, plan.max_steps), plan=plan,
               data=RunData(stages, val_loaders, task_examples, tokenizer), books=books,
               state=state, resumed=start.resumed, sample_generator=generator, extras=extras,
               extras_steps=extras_steps, first_batch=first_batch,
               flops_per_token=raw_model.flops_per_token(),
               peak_flops=cfg.train.peak_flops or place.kind.peak_flops(place.device))


def decide_fast_loss(cfg, place, raw_model, loader, compiled):
    """How the run computes forward's loss (model.choose_fast_loss: the fused loss, the slices, or
    forward's own line), decided before anything else runs the model, in training mode under the
    step's autocast, on the micro-batch the first step reads (the loader is put back: the first
    step reads it again: its first sequences). Returns (what was checked, kept for the checks at
    each evaluation; why the path, for the start line)."""
    position = loader.state_dict()
    first_batch = loader.next_batch()
    loader.load_state_dict(position)
    # Forward's own line holds all the logits, and their gradient, that the fast loss never does:
    # the sequences of one of its slices (model.py), so that the check adds nothing to the run's
    # peak memory (the quick start's whole micro-batch took it from 0.72 to 1.0 GB).
    slice_rows = loss_slice_rows(place.device_type, cfg.model.vocab_size)
    first_batch = tuple(t[:max(1, slice_rows // cfg.model.block_size)] for t in first_batch)
    sharded = cfg.train.data_parallel == "fsdp"  # (whose gradients autograd.grad cannot reach)
    with place.autocast:
        why = choose_fast_loss(raw_model, *first_batch, compiled, gradients=not sharded,
                               agree=functools.partial(all_ranks_agree, place))
    return first_batch, why


def all_ranks_agree(place, holds):
    """Whether `holds` is true on every rank."""
    if place.world_size == 1:
        return holds
    every = torch.tensor([float(holds)], device=place.device)
    dist.all_reduce(every, op=dist.ReduceOp.MIN)
    return bool(every.item())


def start_processes(cfg):
    """Join the job and choose the numerics, from the device table's row. Under torchrun: one
    process per device with its backend (NCCL per GPU, gloo on CPU); a collective that waits
    train.dist_timeout seconds for a rank ends the run."""
    if cfg.train.deterministic:
        from lab.debug import make_deterministic
        make_deterministic()  # before any CUDA work: cuBLAS reads its setting once
    rank, world_size, cpu_group = 0, 1, None
    processes = int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1
    device = pick_device(cfg.train.device, "--train.device", processes)
    kind = device_kind(device)
    if "RANK" in os.environ:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        device = f"{kind.name}:{local_rank}" if kind.backend != "gloo" else kind.name
        timeout = datetime.timedelta(seconds=cfg.train.dist_timeout)
        kind.prepare(device)
        dist.init_process_group(backend=kind.backend, timeout=timeout)
        world_size = dist.get_world_size()
        # NCCL collectives run on the GPU stream; a gloo group lets ranks agree on CPU values (stop
        # now?) without waiting for the GPU. On CPU the default group is gloo already.
        if kind.backend != "gloo":
            cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        kind.prepare(device)
    sharding = None  # the one answer to "is the model sharded?"
    if cfg.train.data_parallel == "fsdp":
        if not dist.is_initialized():
            raise ConfigError("train.data_parallel=fsdp shards the model over torchrun's ranks, "
                              "and this is a plain python process; start it with torchrun "
                              "--nproc-per-node=N, or set --train.data_parallel=ddp.")
        from lab.fsdp import ShardedCheckpoints
        sharding = ShardedCheckpoints()  # every rank saves its pieces, over a gloo group
    use_bf16 = cfg.train.dtype == "bfloat16" or (
        cfg.train.dtype == "auto" and kind.autocast_dtype() == torch.bfloat16)
    # bf16 autocast: matmuls in bfloat16, weights and optimizer state in float32 (no loss scaling).
    autocast = torch.autocast(kind.name, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    return Placement(rank, world_size, device, kind.name, kind, cpu_group, autocast,
                     is_master=rank == 0, sharding=sharding)


def collective_failure(error):
    """run_command's `also`: one sentence for a collective that failed because of another rank,
    else None."""
    text = str(error).lower()
    if not (dist.is_initialized() and isinstance(error, RuntimeError)):
        return None
    if "timed out" in text or "timeout" in text:
        return (f"rank {dist.get_rank()} waited train.dist_timeout seconds at a collective for a "
                f"rank that never came ({str(error).splitlines()[0][-120:]}); another rank is hung "
                "or died: see its output, run `python lab/debug.py stacks OUT_DIR` while a job "
                "hangs, or raise train.dist_timeout if the wait is expected.")
    if "closed by peer" in text or "connection reset" in text:
        return (f"rank {dist.get_rank()} lost its connection to another rank, which ended first; "
                "that rank's output says why (the first error in the log).")
    return None


def prepare_on_first_use(path):
    """A built-in dataset not prepared yet is prepared now; another is an error."""
    if not shard_paths(path, "train"):
        from prepare_data import ensure_dataset
        ensure_dataset(path)


def build_model(cfg, place):
    """(the GPT, with the same initial weights on every rank, on the device; the record of its
    initialisation or None; whether data.batch_size is auto). Under FSDP it is built on `meta`
    (shapes, no numbers) with its record: wrap_model shards it, then each rank fills its own pieces.
    """
    torch.manual_seed(cfg.train.seed)  # the same on every rank: every replica starts identical
    make = functools.partial(gpt_class(cfg.train.model_module), cfg.model,
                             loss_path_on(cfg, place.device_type))
    check_weights_fit_device(make, place.device, place.kind, place.world_size,
                             cfg.train.data_parallel == "fsdp")
    if cfg.train.data_parallel == "fsdp":
        from lab.fsdp import build_for_fsdp
        raw_model, record = build_for_fsdp(make, place.device, place.is_master)
    else:
        raw_model, record = make().to(place.device), None
    auto = cfg.data.batch_size == "auto"
    if auto:  # the largest micro-batch the estimate fits on this GPU
        from lab.auto_batch import resolve_batch_size
        cfg.data.batch_size, why = resolve_batch_size(cfg, raw_model, place.world_size,
                                                      place.device,
                                                      isinstance(place.autocast, torch.autocast))
        if place.is_master:
            print(why, flush=True)
    torch.manual_seed(cfg.train.seed + place.rank)  # from here on each rank draws its own dropout
    if raw_model.config != cfg.model or len(raw_model.blocks) != cfg.model.n_layer:
        raise ConfigError(model_config_differs(cfg, raw_model))
    return raw_model, record, auto


def model_config_differs(cfg, raw_model):
    """The sentence for a model file whose GPT ignores the config it was given."""
    differs = [f"model.{name}={getattr(cfg.model, name)}, it built "
               f"{getattr(raw_model.config, name, None)}" for name in cfg.model.__slots__
               if getattr(raw_model.config, name, None) != getattr(cfg.model, name)]
    if len(raw_model.blocks) != cfg.model.n_layer and not any(
            d.startswith("model.n_layer=") for d in differs):
        differs.append(f"model.n_layer={cfg.model.n_layer}, it built {len(raw_model.blocks)} "
                       f"blocks")
    return (f"train.model_module={cfg.train.model_module}'s GPT was built from a config other than "
            f"the run's model section ({'; '.join(differs)}); build the model from the GPTConfig "
            "it is given, so that its checkpoints load again.")


def wrap_model(cfg, place, raw_model, init_record=None, confirm_batch=False):
    """(model, compiled): the form the loop calls, compiled and/or wrapped in DDP (which all-reduces
    the gradients); the raw model keeps the weights, which the optimizer and checkpoints use. Under
    FSDP the model is sharded in place, both forms at once."""
    compiled = is_compiled(cfg, place.device_type)
    if cfg.train.data_parallel == "fsdp":
        from lab.fsdp import shard_and_fill
        shard_and_fill(raw_model, init_record, cfg.train.seed, place, compiled)
    if confirm_batch:  # data.batch_size=auto: one trial step of the chosen micro-batch
        from lab.auto_batch import confirm_batch_size
        confirm_batch_size(cfg, place, raw_model)
    if cfg.train.data_parallel == "fsdp":
        return raw_model, compiled
    model = torch.compile(raw_model) if compiled else raw_model
    if place.world_size > 1:
        # (one device per process: DDP is told which, except on CPUs)
        model = DDP(model, device_ids=[place.device] if place.kind.backend != "gloo" else None)
    return model, compiled


class Stages:
    """The training data in use at each step and, from stage 2's first step on, stage 2's
    objective: the one place that crosses into stage 2 (lab/stage2.py, imported then), whether the
    run gets there or resumes inside it. `loaders` are [(mixture, loader)] of stage 1 and, with
    stage2.mix, stage 2; `stage2_step` is the number of steps completed when stage 2 begins (None:
    one stage)."""

    def __init__(self, loaders, stage2_step, stage2_cfg, raw_model, out_dir, device,
                 model_module="model"):
        self.loaders, self.stage2_step, self.cfg = loaders, stage2_step, stage2_cfg
        self.raw_model, self.out_dir, self.device = raw_model, out_dir, device
        self.model_module = model_module  # the run's own GPT, which builds stage2.reference
        self.objective = None
        self.resumed_inside = False  # set by resume_at: the reference comes from the boundary

    def resume_at(self, steps_completed, data_state):
        """A resumed run: the data position goes to the loader that saved it."""
        self.loader_at(steps_completed).load_state_dict(data_state)
        self.resumed_inside = self.stage2_step is not None and steps_completed > self.stage2_step

    def loader_at(self, step):
        """The loader step `step` (0: none yet) read from."""
        in_stage2 = self.stage2_step is not None and step > self.stage2_step
        return self.loaders[-1 if in_stage2 else 0][1]

    def for_step(self, step):
        """(mixture, loader, objective) for step `step` (1-based, the step being taken); the
        objective is None in stage 1 (the model's own loss)."""
        if self.stage2_step is None or step <= self.stage2_step:
            return (*self.loaders[0], None)
        if self.objective is None:  # the first step of stage 2 in this process
            from lab.stage2 import begin_stage2
            self.objective = begin_stage2(self)
        return (*self.loaders[-1], self.objective)


def start_wandb(cfg, place, start, config_dict):
    """Rank 0's W&B run (log.wandb; None elsewhere), started before the run folder changes: a W&B
    that cannot start it is one sentence on rank 0, and the other ranks stop quietly."""
    if not cfg.log.wandb:
        return None
    started = [None]  # (the run stays here: from_rank0 sends the other ranks only that it began)

    def begin():
        started[0] = metrics.start_wandb(cfg.train.out_dir, cfg.log, config_dict, start.resumed)

    run_dir.from_rank0(begin, place.rank, place.world_size, place.cpu_group)
    return started[0]


def start_bookkeeping(cfg, place, plan, replaced, replaced_in_bucket, config_dict, stack,
                      wandb_run):
    """What runs beside the loop: the metric recorder and its writer, the checkpointer (and its
    uploads) and the stopper. `replaced` / `replaced_in_bucket`: another run's checkpoints this one
    replaces (save_overwrite); `wandb_run`: rank 0's W&B run (start_wandb), or None."""
    out_dir, threads = cfg.train.out_dir, async_bookkeeping(cfg, place)
    writer = stack.enter_context(metrics.RowWriter(
        out_dir if place.is_master else None, plan.end_step, plan.console,
        cfg.train.loss_spike_threshold, prints=threads, wandb_run=wandb_run))
    # Async bookkeeping gets a gloo group of its own: its collectives run on another thread.
    group = dist.new_group(backend="gloo") if threads and place.world_size > 1 else None
    recorder = metrics.MetricRecorder(place.device, place.world_size, threads, group,
                                      on_rows=writer, soft_timeout=cfg.log.bookkeeping_soft_timeout,
                                      copy_event=place.kind.copy_event)
    stack.callback(recorder.close)
    uploader = None
    if cfg.checkpoint.remote_folder and place.is_master:  # uploads on a thread of their own
        from lab import remote
        uploader = remote.start_uploads(cfg.checkpoint, lambda: run_dir.run_records(out_dir),
                                        replaced_in_bucket, writer, stack)
    checkpointer = Checkpointer(out_dir, cfg.checkpoint, config_dict, place.is_master,
                                replaced=replaced, uploader=uploader, sharding=place.sharding,
                                soft_timeout=cfg.log.bookkeeping_soft_timeout)
    stack.callback(checkpointer.wait)  # a save in flight lands before the process exits
    wandb_cancel = None  # rank 0 asks W&B whether the run was tagged to cancel it
    if writer.wandb_run is not None and cfg.log.wandb_cancel_tags:
        wandb_cancel = stack.enter_context(metrics.WandbCancel(
            writer.wandb_run, cfg.log.wandb_cancel_tags, cfg.log.wandb_cancel_seconds))
    signals = stack.enter_context(SignalFlag(saves=not cfg.train.no_checkpoints))
    stopper = Stopper(signals, out_dir, cfg.train.time_limit, cfg.train.cancel_check_interval,
                      place.is_master, writer, place.cpu_group, wandb_cancel)
    return Books(recorder, writer, checkpointer, stopper, notifier=None)


def async_bookkeeping(cfg, place):
    """log.async_bookkeeping resolved: auto is on where a gloo group exists (more than one rank)."""
    return cfg.log.async_bookkeeping == "true" or (
        cfg.log.async_bookkeeping == "auto" and place.world_size > 1)


def needs_step_extras(cfg, plan, compiled):
    """Whether any of lab/step_extras.py's parts is on: traces, activation statistics, skipped
    data, per-layer gradient norms, NaN skipping, timing compilation, the profiler, every rank's
    line."""
    return bool(cfg.debug.trace_steps or cfg.log.activations_interval or plan.skipped
                or cfg.log.grad_norms_interval or cfg.train.nan_policy == "skip" or compiled
                or cfg.log.profile or cfg.log.all_ranks)


if __name__ == "__main__":
    run_command(main, sys.argv[1:], also=collective_failure)
