"""The step's optional parts, behind one call from train.py's loop: module traces (debug.trace_steps), activation
statistics (log.activations_interval), skipping known-bad data (train.steps_to_skip), per-layer gradient norms
(log.grad_norms_interval), skipping non-finite steps (train.nan_policy=skip), timing torch.compile's first step,
Python's garbage collector (train.gc_interval) and the profiler (log.profile). The run's end on a non-finite step
(`stop_on_nonfinite`, which the loop calls only when a step was non-finite, and its error `NonFiniteLoss`) and the
console line of each rank other than 0 (`rank_line`, log.all_ranks) are here too.

`StepExtras.steps` holds every step at which one of them has work (a `range` or a set: the loop's test
`step in extras.steps` calls no function). At those steps the loop calls `extras.step(...)`, which runs them around
`train.train_step`; at every other step it calls `train_step` alone, so the step a reader follows visits none of
this. train.py imports this file when it builds a run.
"""

import gc
import os
import time

import torch

from callbacks import host_values, nonfinite_message
from checkpoint import newest_checkpoint
from config import UserError
from metrics import console_line


class StepExtras:
    """The optional parts this run turned on, the steps they run at (`steps`) and what they keep between steps."""

    def __init__(self, cfg, plan, first_step, compiled, is_master, stack):
        self.cfg, self.plan, self.is_master = cfg, plan, is_master
        self.compile_step = first_step if compiled else None  # the first step this process takes compiles
        self.in_a_row = 0  # non-finite steps skipped in a row (nan_policy=skip)
        self.give_up = ""  # the sentence to stop with once nan_skip_limit steps in a row were skipped
        if cfg.train.gc_interval:  # OLMo's GarbageCollector: no pause at a random moment, which every rank waits for
            gc.disable()
            stack.callback(gc.enable)
        self.profiler = stack.enter_context(make_profiler(cfg)) if cfg.log.profile and is_master else None
        end = plan.end_step
        if cfg.train.nan_policy == "skip" or self.profiler:  # every step (the profiler's window: see make_profiler)
            self.steps = range(first_step, end + 1)
            return
        steps = {s for every in (plan.traces, plan.activations, plan.grad_norms) for s in periodic(every, end)}
        steps |= {s for start, stop in plan.skipped for s in range(start, stop)}
        steps |= set(range(cfg.train.gc_interval, end + 1, cfg.train.gc_interval)) if cfg.train.gc_interval else set()
        self.steps = {s for s in steps if first_step <= s <= end} | ({first_step} if compiled else set())

    def step(self, run, step, loader, objective, clock, train_step):
        """Step `step` with whatever of the above is due at it: ({metric: value}, data seconds), as train_step."""
        plan, cfg = self.plan, self.cfg
        if plan.traces.due(step):  # every module's inputs and outputs, saved by rank 0 (debug.py)
            from lab import debug
            with clock.aside("trace"):  # (on every rank, as all record the same metrics)
                if self.is_master:
                    debug.trace_forward(run.raw_model, loader, run.autocast, cfg.train.out_dir, step,
                                        cfg.debug.trace_sequences)
        if plan.activations.due(step):  # each block's activations and each layer's weights, off the step's clock
            from lab.debug import activation_stats
            with clock.aside("activations"):
                run.recorder.record_all(activation_stats(run.raw_model, loader, run.autocast))
        start = time.perf_counter()
        if plan.skips_data(step):  # train.steps_to_skip: read past a known-bad stretch of data, untrained
            loader.skip_batches(plan.grad_accum_steps)
            step_metrics, data_time = {"train/skipped_data_step": 1.0}, 0.0
        else:
            step_metrics, data_time = train_step(
                run.model, run.optimizer, loader, plan.grad_accum_steps, run.autocast, grad_clip=cfg.optim.grad_clip,
                nan_policy=cfg.train.nan_policy, objective=objective, layer_norms=plan.grad_norms.due(step))
        if step == self.compile_step:  # its time, GPU work included (one sync, once)
            clock.synchronize()
            seconds = time.perf_counter() - start
            if self.is_master:
                print(f"step {step} took {seconds:.1f} s, compiling included", flush=True)
            run.recorder.record_all({"throughput/compile_time_sec": seconds})
        if cfg.train.nan_policy == "skip":  # (skip mode reads the flag on the host: one sync per step)
            self.in_a_row = self.in_a_row + 1 if "train/skipped_nonfinite_step" in step_metrics else 0
            run.state.nonfinite_skipped += self.in_a_row > 0
            run.recorder.record_all({"train/nonfinite_steps_skipped": run.state.nonfinite_skipped})
            if cfg.train.nan_skip_limit and self.in_a_row >= cfg.train.nan_skip_limit:
                self.give_up = (f"the loss or gradient was non-finite at {self.in_a_row} steps in a row up to step "
                                f"{step} (train.nan_policy=skip), so the weights are no longer trained")
        if cfg.train.gc_interval and step % cfg.train.gc_interval == 0:
            gc.collect(1)  # on every rank at the same step
        if self.profiler:
            self.profiler.step()
        return step_metrics, data_time

    def stop_on_nonfinite(self, run, step, step_metrics):
        """After the step's rows are written: a non-finite loss or gradient (train.nan_policy=stop: named by the rows,
        or by this step's own numbers), or train.nan_skip_limit skipped steps in a row, ends the run."""
        if run.writer.nonfinite and self.cfg.train.nan_policy == "stop":
            raise nonfinite_stop(run.writer.nonfinite, self.cfg.train.out_dir)
        if self.give_up:
            raise nonfinite_stop(self.give_up, self.cfg.train.out_dir, skip=False)
        check_finite(step, step_metrics, self.cfg.train.out_dir)  # (the rows hold it: this names the step only if not)


def rank_line(rank, step, step_metrics):
    """log.all_ranks: this rank's own loss, prefixed with its rank (the logged row holds the mean over ranks, and the
    gradient norm is the same on every rank). One host sync, on the steps it prints."""
    own = {name: float(value) for name, value in step_metrics.items() if name == "train/loss"}
    return f"[rank {rank}] {console_line(step, own)}"


def grad_norm(params):
    """The norm of the gradients of `params` taken together (those that have one), on the device."""
    grads = [p.grad.norm() for p in params if p.grad is not None]
    # FSDP: the norm of a rank's piece is a DTensor, and full_tensor() gives the whole gradient's (a small collective)
    grads = [norm.full_tensor() if hasattr(norm, "full_tensor") else norm for norm in grads]
    return torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.zeros(())


def per_layer_grad_norms(raw_model):
    """The gradient norm of the embeddings (grad/embedding) and of each block (grad/layerNN), to find which layer
    blows up. The model says which parameters are embeddings and which modules are its blocks."""
    norms = {"grad/embedding": grad_norm(raw_model.param_groups()["embedding"])}
    for i, block in enumerate(raw_model.blocks):
        norms[f"grad/layer{i:02d}"] = grad_norm(block.parameters())
    return norms


def periodic(every, end_step):
    """The steps from 1 to `end_step` at which `every` (a plan.Every) is due."""
    steps = set(every.fixed)
    if every.interval:
        steps |= set(range(every.interval, end_step + 1, every.interval)) | {end_step}
    return steps


def make_profiler(cfg):
    """torch.profiler over one window of steps (log.profile_wait, _warmup, _active), on rank 0; the trace
    (chrome://tracing, Perfetto, TensorBoard) lands in <out_dir>/profiler/."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    log = cfg.log
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=log.profile_wait, warmup=log.profile_warmup, active=log.profile_active,
                                         repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(os.path.join(cfg.train.out_dir, "profiler"),
                                                               worker_name="rank0"),
    )


class NonFiniteLoss(UserError):
    """Training produced NaN or Inf; the message says what to do."""


def nonfinite_stop(what, out_dir, skip=True):
    """NonFiniteLoss for `what` (what went non-finite, and where), with the way on for this run: resume from its last
    checkpoint, or start again if it has none. `skip`: offer train.nan_policy=skip (a run that skips has a limit)."""
    last = newest_checkpoint(out_dir) if out_dir else None
    restart = f"resume from its last checkpoint, {os.path.basename(last)}," if last else \
        "start again (the run has no checkpoint to resume)"
    then = ", or set train.nan_policy=skip to skip such steps" if skip else \
        " (train.nan_skip_limit sets how many in a row)"
    return NonFiniteLoss(f"{what}; {restart} with a lower optim.lr{then}.")


def check_finite(step, values, out_dir=None):
    """NonFiniteLoss, naming `step`, if the step's train/loss or train/grad_norm is not finite."""
    message = nonfinite_message(step, host_values(values))
    if message:
        raise nonfinite_stop(message, out_dir)
