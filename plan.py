"""The run's plan: its length, its micro-steps per step, what is due after each step, and when it
stops early.

`make_plan` resolves the config into a `Plan` once, before anything is written; the loop asks
`plan.due(step)` after every step, `--dry_run` prints it. `Every` is the one cadence rule for
everything periodic; it fires at the last step too, so the final evaluation and checkpoint reuse
the periodic code. The final checkpoint is always written (a run that stops must be resumable)
unless `train.no_checkpoints`. Last, the start-up summary and the memory estimate.

`Stopper` stops cleanly on SIGTERM (a scheduler's preemption), Ctrl-C, a `<out_dir>/CANCEL` file,
a cancel tag on the run in W&B, the time limit or a metrics write error: the loop finishes the step,
saves a checkpoint and exits, so at most one step is lost. Ranks see the cause at different moments
(a signal reaches them one by one, only rank 0 looks for the file and asks W&B), so every
train.cancel_check_interval steps they agree in one tiny all-reduce on a CPU (gloo) group, which
never waits for the GPU.

The table of devices (what runs where) is devices.py's.
"""

import os
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from config import (ConfigError, check_warmup, duration_to_steps,
                    parse_step_ranges)
from devices import device_kind
from metrics import SinkError
from model import GPT, choose_loss_path, loss_slice_rows, loss_slices


@dataclass(frozen=True)
class Every:
    """Every `interval` steps and at the last step (interval 0: not periodically), and at `fixed`
    steps."""
    interval: int = 0
    fixed: tuple = ()

    def due(self, step, last=False):
        return step in self.fixed or (self.interval > 0 and step > 0 and
                                      (step % self.interval == 0 or last))

    def steps(self, end_step):
        """Every step up to `end_step` (the last) at which `due` fires, as a set."""
        steps = {s for s in self.fixed if s <= end_step}
        if self.interval > 0:
            steps |= set(range(self.interval, end_step + 1, self.interval)) | {end_step}
        return steps


@dataclass(frozen=True)
class Due:
    """What runs after a step, in the loop's order."""
    val: bool = False  # validation losses
    tasks: bool = False  # downstream tasks (HellaSwag is one of them)
    checkpoint: str | None = None  # the kind of checkpoint to save: fixed, permanent, ephemeral
    sample: bool = False  # text samples (rank 0)
    # metrics to the host and the sinks: at console lines and evaluations, so that a line prints on
    # the step it describes, and before a checkpoint, so that metrics.jsonl is then complete
    write_metrics: bool = False
    evals: bool = False  # val or tasks
    collect_garbage: bool = False  # gc.collect on every rank (train.gc_interval)


NOTHING = Due()  # an ordinary step


@dataclass(frozen=True)
class StepOptions:
    """What train_step does differently at a step, at the steps lab/step_extras.py lists (its
    `before_step` says)."""
    skip_data: bool = False  # train.steps_to_skip: read the step's batches, train nothing
    layer_norms: bool = False  # log.grad_norms_interval: per-layer gradient norms, before clipping
    nan_policy: str = "stop"  # train.nan_policy: "skip" passes over a non-finite step (one sync)


PLAIN_STEP = StepOptions()  # an ordinary step


@dataclass(frozen=True)
class Plan:
    grad_accum_steps: int  # micro-steps per optimizer step on each rank
    tokens_per_step: int  # train.total_batch_size
    max_steps: int  # the LR schedule's length
    end_step: int  # where this run stops: max_steps, or earlier with train.hard_stop
    stage2_step: int | None  # steps completed when stage 2 begins (None: one stage)
    val: Every
    tasks: Every
    samples: Every
    checkpoints: Every  # permanent ones (the final one is always saved)
    fixed_checkpoints: tuple  # kept forever: checkpoint.fixed_steps and the stage-2 boundary
    ephemeral: Every  # only the newest is kept
    # an ephemeral checkpoint this soon after a fixed or permanent one: none
    ephemeral_cooldown: int
    traces: Every  # debug.trace_steps: fixed steps only
    metrics: Every  # log.metrics_collect_interval: one sync and one collective each time
    console: Every  # log.interval: a console line, so its metrics are written at that step
    grad_norms: Every  # log.grad_norms_interval: per-layer gradient norms
    activations: Every  # log.activations_interval: activation statistics and parameter norms
    garbage: Every  # train.gc_interval
    no_checkpoints: bool
    skipped: tuple = ()  # train.steps_to_skip as (start, end) ranges: data read, not trained on

    def skips_data(self, step):
        return any(start <= step < end for start, end in self.skipped)

    def due(self, step, last=False, stop=False):
        """What runs after `step`; `last` at the run's end. On an early stop (signal, CANCEL, time
        limit) only the checkpoint: a scheduler's grace period is short, and an evaluation could
        eat it."""
        if stop and not last:
            checkpoint = None if self.no_checkpoints else "permanent"
            return Due(checkpoint=checkpoint, write_metrics=True)
        cadences = (self.val, self.tasks, self.samples, self.checkpoints, self.ephemeral,
                    self.metrics, self.console, self.garbage)
        if not (last or step in self.fixed_checkpoints or any(every.due(step)
                                                               for every in cadences)):
            return NOTHING  # (most steps)
        checkpoint = None  # the kind of checkpoint due, if any
        if self.no_checkpoints:
            pass
        elif step in self.fixed_checkpoints:
            checkpoint = "fixed"
        elif last or self.checkpoints.due(step):
            checkpoint = "permanent"
        elif self.ephemeral.due(step):
            recent = range(max(1, step - self.ephemeral_cooldown + 1), step)  # OLMo-core's cooldown
            if not any(s in self.fixed_checkpoints or self.checkpoints.due(s) for s in recent):
                checkpoint = "ephemeral"
        val, tasks = self.val.due(step, last), self.tasks.due(step, last)
        sample, evals = self.samples.due(step, last), val or tasks
        write = (self.metrics.due(step, last) or self.console.due(step, last) or evals
                 or bool(checkpoint))
        return Due(val=val, tasks=tasks, checkpoint=checkpoint, sample=sample, evals=evals,
                   write_metrics=write, collect_garbage=self.garbage.due(step))

    def checkpoint_steps(self):
        """Every step a checkpoint will be saved at if the run is not stopped early (step 0 too)."""
        return [s for s in range(0 if 0 in self.fixed_checkpoints else 1, self.end_step + 1)
                if self.due(s, last=s == self.end_step).checkpoint]


def make_plan(cfg, world_size, tokens_per_epoch, non_embedding_params):
    """The Plan of a run; a batch that does not divide, or a stage 2 that never begins, is one
    sentence."""
    t = cfg.train
    tokens_per_micro_step = cfg.data.batch_size * cfg.model.block_size * world_size
    if t.total_batch_size % tokens_per_micro_step:
        raise ConfigError(
            f"train.total_batch_size={t.total_batch_size} is not a multiple of data.batch_size x "
            f"model.block_size x world_size = {cfg.data.batch_size} x {cfg.model.block_size} x "
            f"{world_size} = {tokens_per_micro_step}; change one of them so it divides.")

    def steps(duration, key):
        return duration_to_steps(duration, t.total_batch_size, tokens_per_epoch,
                                 non_embedding_params, key=key)

    max_steps = steps(t.max_duration, "train.max_duration") if t.max_duration else t.max_steps
    end_step = min(max_steps, steps(t.hard_stop, "train.hard_stop")) if t.hard_stop else max_steps
    stage2_step = steps(cfg.stage2.start, "stage2.start") if cfg.stage2.start else None
    if stage2_step is not None and stage2_step >= max_steps:
        raise ConfigError(f"stage2.start={cfg.stage2.start} is step {stage2_step}, not before the "
                          f"run's end at step {max_steps}; start stage 2 earlier or train longer.")
    check_warmup(cfg.optim.warmup_steps, max_steps)
    e, c, log = cfg.eval, cfg.checkpoint, cfg.log
    if e.tasks and not (e.tasks_interval or e.fixed_steps):  # (here: the ladder sets fixed_steps)
        raise ConfigError(f"eval.tasks={','.join(e.tasks)} would never run: set "
                          f"eval.tasks_interval (every N steps and at the end) or eval.fixed_steps "
                          f"(at those steps only).")
    evals, never = not t.no_evals, Every()  # train.no_evals: no validation, tasks or samples
    boundary = (stage2_step,) if stage2_step is not None else ()
    return Plan(
        grad_accum_steps=t.total_batch_size // tokens_per_micro_step,
        tokens_per_step=t.total_batch_size, max_steps=max_steps, end_step=end_step,
        stage2_step=stage2_step,
        val=Every(e.interval, tuple(e.fixed_steps)) if evals else never,
        tasks=Every(e.tasks_interval, tuple(e.fixed_steps)) if evals and e.tasks else never,
        samples=Every(e.sample_interval) if evals else never,
        checkpoints=Every(c.interval), fixed_checkpoints=tuple(c.fixed_steps) + boundary,
        ephemeral=Every(c.ephemeral_interval), ephemeral_cooldown=c.ephemeral_cooldown,
        traces=Every(0, tuple(cfg.debug.trace_steps)), metrics=Every(log.metrics_collect_interval),
        console=Every(log.interval), grad_norms=Every(log.grad_norms_interval),
        activations=Every(log.activations_interval), garbage=Every(t.gc_interval),
        no_checkpoints=t.no_checkpoints, skipped=tuple(parse_step_ranges(t.steps_to_skip)))


# --------------------------------------------------------------------------------- stopping early


# index 0: keep training; a higher index wins when ranks see different reasons
REASONS = ("", "signal", "cancel file", "wandb tag", "time limit", "write error")


class SignalFlag:
    """Remembers the first SIGTERM/SIGINT; a second SIGINT exits at once. A context manager: the
    handlers it replaced come back when the run ends (train.train may run inside another program).
    """

    def __init__(self, saves=True):
        self.received, self.previous = None, {}  # the signal received; the handlers replaced
        self.saves = saves  # whether the stop saves a checkpoint (not with train.no_checkpoints)

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None and signum == signal.SIGINT:
            print("second SIGINT: exiting now without saving", file=sys.stderr, flush=True)
            os._exit(130)
        if self.received is not None:  # already stopping (ladder.py run-all follows a Ctrl-C
            return  # with a SIGTERM)
        self.received = name
        saving = "saving a checkpoint, " if self.saves else ""
        print(f"{name} received: finishing this step, {saving}then exiting "
              f"(Ctrl-C again exits at once)", file=sys.stderr, flush=True)


class Stopper:
    """`poll(step)` after every step: the reason to stop now that the ranks agree on, or "". They
    agree every `check_interval` steps (one small collective) and at no other step. `stopped`
    says, once the stop's checkpoint has landed, why the run stopped."""

    def __init__(self, flag, out_dir, time_limit, check_interval, is_master, writer=None,
                 group=None, wandb_cancel=None):
        self.flag, self.out_dir, self.time_limit = flag, out_dir, time_limit
        self.interval = check_interval
        self.is_master, self.writer, self.group = is_master, writer, group
        self.wandb_cancel = wandb_cancel  # rank 0's metrics.WandbCancel (log.wandb_cancel_tags)
        self.start_time = time.monotonic()

    def poll(self, step):
        if step % self.interval:
            return ""
        reason = ""
        if self.writer is not None and self.writer.failed:  # rank 0 cannot write its metrics
            reason = "write error"
        elif self.flag.received:
            reason = "signal"
        elif self.is_master and os.path.exists(os.path.join(self.out_dir, "CANCEL")):
            reason = "cancel file"
        elif self.wandb_cancel is not None and self.wandb_cancel.tag:  # (its thread's answer)
            reason = "wandb tag"
        elif self.time_limit and time.monotonic() - self.start_time > self.time_limit:
            reason = "time limit"
        if self.wandb_cancel is not None:
            self.wandb_cancel.ask()  # answered by a later check
        if not dist.is_initialized():
            return reason
        code = torch.tensor([REASONS.index(reason)], dtype=torch.int32)  # the reason any rank has:
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=self.group)  # every rank polls alike
        return REASONS[int(code)]

    def stopped(self, reason, step, saved):
        """After the stop's checkpoint (if `saved`) has landed: say why the run stopped (rank 0),
        remove a CANCEL file that did its job (left there, it would cancel the resumed run at once)
        and return the outcome, for the webhook. A metrics write error ends the run with its
        sentence."""
        if reason == "write error":
            failed = (self.writer.failed if self.writer is not None and self.writer.failed
                      else "rank 0 could not write its metrics")
            raise SinkError(f"{failed}; a checkpoint was saved at step {step}: free disk space, "
                            "then run the same command again to resume.")
        if reason == "signal":
            why = f"stopped by {self.flag.received or 'a signal on another rank'}"
        elif reason == "cancel file":
            why = f"canceled by {os.path.join(self.out_dir, 'CANCEL')} (now removed)"
        elif reason == "wandb tag" and self.wandb_cancel is not None:  # rank 0
            tag = self.wandb_cancel.tag
            untagged = saved and self.wandb_cancel.untag()
            why = f"cancelled in W&B (tag {tag}{', now removed' if untagged else ''})"
            if not untagged:
                why += f"; remove the tag {tag} in W&B, or the run stops again when resumed"
        elif reason == "wandb tag":
            why = "cancelled in W&B"
        else:
            why = "stopped at the time limit (train.time_limit)"
        if self.is_master:
            if reason == "cancel file":
                os.remove(os.path.join(self.out_dir, "CANCEL"))
            print(f"{why} after step {step}; " + (
                "the checkpoint is saved: run the same command again to resume." if saved else
                "train.no_checkpoints saved no checkpoint, so running the command again starts "
                "from step 0."), flush=True)
        return f"{why} after step {step}; " + (
            "its checkpoint is saved" if saved else "no checkpoint (train.no_checkpoints)")


# --------------------------------------------------------- the start-up summary and memory estimate


def is_compiled(cfg, device_type):
    return cfg.train.compile == "true" or (cfg.train.compile == "auto" and
                                           device_kind(device_type).compile)


def loss_path_on(cfg, device_type):
    """train.loss_path resolved on this kind of device: auto is the path its row measured fastest.
    """
    fastest = (device_kind(device_type).compiled_loss_path if is_compiled(cfg, device_type)
               else "chunked")
    return choose_loss_path(cfg.train.loss_path, fastest)


def shares_text(mix):
    return ", ".join(f"{name} {share:.1%}" for name, share in mix)


def describe_run(cfg, raw_model, plan, *, world_size, device, sequences_per_epoch, compiled,
                 loss_why=""):
    """The start-up summary a student reads: the model's size, the batch and the run's cost, from
    the model and plan; `compiled`: whether the loop calls torch.compile's form of the model (the
    run's own; a dry run's from the config); `loss_why`: why the model computes its loss as it does
    (train.py decided it, model.choose_fast_loss; "" before that, in a dry run)."""
    params, non_embedding = raw_model.num_params(), raw_model.num_params(non_embedding=True)
    tokens = plan.max_steps * plan.tokens_per_step
    stop = ""
    if plan.end_step < plan.max_steps:
        stop = f", stopping after step {plan.end_step:,} (train.hard_stop)"
    device_type = torch.device(device).type
    micro_batch_tokens = cfg.data.batch_size * cfg.model.block_size
    bf16 = cfg.train.dtype == "bfloat16" or (
        cfg.train.dtype == "auto" and device_kind(device_type).autocast_dtype() == torch.bfloat16)
    data = (f"{sequences_per_epoch:,} training sequences per epoch" if sequences_per_epoch else
            "data not prepared yet")
    return (f"model: {params:,} parameters ({non_embedding:,} non-embedding); {world_size} rank(s) "
            f"on {device}, {plan.grad_accum_steps} micro-step(s) per step; output layer + loss: "
            f"{loss_description(raw_model, micro_batch_tokens, device_type, loss_why)}"
            f"{'; torch.compile' if compiled else ''}\n"
            f"run: {plan.max_steps:,} steps x {plan.tokens_per_step:,} tokens = {tokens:,} tokens "
            f"({tokens / non_embedding:.1f} per non-embedding parameter; {data}), "
            f"{raw_model.flops_per_token() * tokens:.3g} training FLOPs{stop}\n"
            + describe_memory(raw_model, micro_batch_tokens, world_size, bf16, device_type))


def loss_description(raw_model, rows, device_type, why):
    """How this model computes its loss, read from the model, and `why`: the fused loss, the slices
    through `logits` (with the slices per micro-step) or the full logits of forward's own line
    (GPT.fast_loss). A model with a forward of its own (a subclass, a train.model_module file) says
    so: what it computes is its own. Before the choice (`why` is ""), what decides it."""
    if type(raw_model).forward is not GPT.forward or not hasattr(raw_model, "fast_loss"):
        return "the model's own forward" + (f" ({why})" if why else "")
    slices = loss_slices(rows, raw_model.config.vocab_size, device_type)
    if not why:
        return ("full logits (as train.loss_path asks)" if raw_model.loss_path == "full" else
                "fused, slices through `logits` or full logits, whichever gives forward's loss on "
                "the first micro-batch")
    path = {"fused": f"fused in {slices} slice(s) per micro-step",
            "sliced": f"slices through `logits`, {slices} per micro-step",
            "": "full logits"}[raw_model.fast_loss]
    return f"{path} ({why})"


def memory_per_rank(model, micro_batch_tokens, world_size, sharded, bf16, device_type):
    """Bytes each rank needs, estimated before the run: {weights, gradients, optimizer, activations,
    total}.

    fp32 weights and gradients take 4 bytes a parameter and AdamW's two moments 8 (Muon keeps one
    moment for the matrices: less). DDP holds all of them on every rank; with more than one rank, a
    second copy of the gradients in the buckets it all-reduces (4); with bf16 autocast, the bf16
    copy of the weights it casts once per step (2). FSDP holds 1/world_size of the three, plus whole
    weights gathered for the parts running (two blocks: the one running and the next, fetched ahead;
    and the rest of the model, the embeddings and output layer, gathered for the whole step), in
    bf16 or fp32, and the whole gradient of the largest part before it is reduce-scattered.
    Activations of one micro-batch, kept for the backward: 34 x width bytes per token and layer with
    bf16 and fused attention, which keeps no sequence x sequence scores (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", eq. 2 without its 5as/h term),
    twice that in fp32; then the output layer: the full path's logits, their softmax and its
    gradient (3 x tokens x vocabulary x 4 bytes), or the chunked path's slice of them and its weight
    gradient. Against measured peaks: docs/fsdp.md."""
    n = model.num_params()
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    # rest: what is not in a block (embeddings, final norm, output)
    block, rest = max(blocks), n - sum(blocks)
    cfg, share = model.config, world_size if sharded else 1
    weights, gradients, optimizer = 4 * n / share, 4 * n / share, 8 * n / share
    if sharded:  # the gathered weights of the largest unit at a time, and its gradients
        weights += (2 * block + rest) * (2 if bf16 else 4)
        gradients += 4 * max(block, rest)
    elif bf16:  # autocast's bf16 copy of every weight
        weights += 2 * n
    if not sharded and world_size > 1:
        # DDP's buckets: the gradients copied into the flat buffers it all-reduces
        gradients += 4 * n
    vocab = cfg.vocab_size  # the width of the logits (GPT.logits)
    rows = micro_batch_tokens if getattr(model, "loss_path", "full") == "full" else min(
        micro_batch_tokens, loss_slice_rows(device_type, vocab))
    output = 3 * rows * vocab * 4 + (4 * vocab * cfg.n_embd if rows < micro_batch_tokens else 0)
    activations = 34 * cfg.n_embd * cfg.n_layer * micro_batch_tokens * (1 if bf16 else 2) + output
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer,
            "activations": activations, "total": weights + gradients + optimizer + activations}


def check_weights_fit_device(make, device, kind, world_size, sharded):
    """One sentence, before the model is built, when the estimate's weights alone (memory_per_rank,
    built on the meta device) pass the memory this process can get on the device: building it
    would end in an allocation traceback (model.block_size=1e8 asks for a 51 GB position table)."""
    have = kind.capacity(device)
    if not have:
        return
    with torch.device("meta"):
        shape = make()
    weights = memory_per_rank(shape, 0, world_size, sharded, False, kind.name)["weights"]
    if weights > have:
        c = shape.config
        raise ConfigError(f"the model (block_size={c.block_size}, vocab_size={c.vocab_size}, "
                          f"n_layer={c.n_layer}, n_embd={c.n_embd}) needs {weights / 1e9:,.1f} GB "
                          f"for its weights alone, more than the {have / 1e9:,.1f} GB this "
                          f"process can get on this {kind.what}; make it smaller.")


def describe_memory(model, micro_batch_tokens, world_size, bf16, device_type):
    """One line: the estimated bytes per rank with DDP (the parts) and with FSDP at this world size.
    """
    ddp = memory_per_rank(model, micro_batch_tokens, world_size, False, bf16, device_type)
    fsdp = memory_per_rank(model, micro_batch_tokens, world_size, True, bf16, device_type)
    gb = 1e9
    return (f"memory per rank (estimate): weights {ddp['weights'] / gb:.2f} GB, gradients "
            f"{ddp['gradients'] / gb:.2f}, AdamW {ddp['optimizer'] / gb:.2f}, activations "
            f"{ddp['activations'] / gb:.2f} at {micro_batch_tokens:,} tokens = "
            f"{ddp['total'] / gb:.2f} GB with DDP; {fsdp['total'] / gb:.2f} GB with FSDP on "
            f"{world_size} rank(s)")
