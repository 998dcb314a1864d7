"""The step's optional parts, around train.py's `train_step`: module traces (debug.trace_steps),
activation statistics (log.activations_interval), skipping known-bad data (train.steps_to_skip),
per-layer gradient norms (log.grad_norms_interval), skipping non-finite steps
(train.nan_policy=skip), timing torch.compile's first step, the profiler (log.profile) and every
rank's own line (log.all_ranks).

`StepExtras.steps` holds every step at which one of them has work (a `range` or a set). At those
steps the loop calls `before_step`, which runs what comes before the step and returns
`train_step`'s options (plan.StepOptions), then `after_step`; at every other step it calls neither.
"""

import os
import time

import torch

from plan import StepOptions



class StepExtras:
    """The optional parts this run turned on, the steps they run at (`steps`) and what they keep
    between steps."""

    def __init__(self, cfg, plan, first_step, compiled, is_master, stack):
        self.cfg, self.plan, self.is_master = cfg, plan, is_master
        self.compile_step = first_step if compiled else None  # this process's first step compiles
        self.in_a_row = 0  # non-finite steps skipped in a row (nan_policy=skip)
        self.started = 0.0  # when the step began (the compiling step's time)
        self.profiler = None
        if cfg.log.profile and is_master:
            self.profiler = stack.enter_context(make_profiler(cfg))
        end = plan.end_step
        if cfg.train.nan_policy == "skip" or self.profiler:  # every step
            self.steps = range(first_step, end + 1)
            return
        steps = {s for every in (plan.traces, plan.activations, plan.grad_norms)
                 for s in every.steps(end)}
        steps |= {s for start, stop in plan.skipped for s in range(start, stop)}
        if cfg.log.all_ranks:
            steps |= plan.console.steps(end)
        if compiled:  # the first step's time, compiling included
            steps.add(first_step)
        self.steps = {s for s in steps if first_step <= s <= end}

    def before_step(self, run, step, loader, clock):
        """What runs before step `step`; returns train_step's options for it."""
        plan, cfg = self.plan, self.cfg
        # every module's inputs and outputs, saved by rank 0 (lab/debug.py)
        if plan.traces.due(step):
            from lab import debug
            with clock.paused("trace"):  # (on every rank, as all record the same metrics)
                if self.is_master:
                    debug.trace_forward(run.raw_model, loader, run.place.autocast,
                                        cfg.train.out_dir, step,
                                        cfg.debug.trace_sequences)
        if plan.activations.due(step):  # each block's activations and each layer's weights
            from lab.debug import activation_stats
            with clock.paused("activations"):
                stats = activation_stats(run.raw_model, loader, run.place.autocast)
                run.books.recorder.record_all(stats)
        self.started = time.perf_counter()
        return StepOptions(skip_data=plan.skips_data(step), layer_norms=plan.grad_norms.due(step),
                           nan_policy=cfg.train.nan_policy)

    def after_step(self, run, step, step_metrics, clock):
        """What runs after step `step`'s train_step, before its metrics are recorded. Returns why
        the run must end (too many non-finite steps skipped in a row), or ""."""
        cfg, ended = self.cfg, ""
        if step == self.compile_step:  # its time, GPU work included (one sync, once)
            clock.synchronize()
            seconds = time.perf_counter() - self.started
            if self.is_master:
                print(f"step {step} took {seconds:.1f} s, compiling included", flush=True)
            run.books.recorder.record_all({"throughput/compile_time_sec": seconds})
        # (skip mode reads the flag on the host: one sync a step)
        if cfg.train.nan_policy == "skip":
            if "train/skipped_nonfinite_step" in step_metrics:
                self.in_a_row += 1
                run.state.nonfinite_skipped += 1
            else:
                self.in_a_row = 0
            run.books.recorder.record_all(
                {"train/nonfinite_steps_skipped": run.state.nonfinite_skipped})
            if cfg.train.nan_skip_limit and self.in_a_row >= cfg.train.nan_skip_limit:
                # the loop stops on it once this step's row is written, as on any non-finite loss
                ended = (f"the loss or gradient was non-finite at {self.in_a_row} steps in a row "
                         f"up to step {step} (train.nan_policy=skip), so the weights are no longer "
                         "trained")
        if self.profiler:
            self.profiler.step()
        last = step == self.plan.end_step
        if cfg.log.all_ranks and not self.is_master and self.plan.console.due(step, last):
            # this rank's own loss (the logged row holds the mean over ranks); one host sync
            if "train/loss" in step_metrics:
                print(f"[rank {run.place.rank}] step {step:>6} | loss "
                      f"{float(step_metrics['train/loss']):.4g}",
                      flush=True)
        return ended


def grad_norm(params):
    """The norm of the gradients of `params` taken together (those that have one), on the device."""
    grads = [p.grad.norm() for p in params if p.grad is not None]
    # FSDP: the norm of a rank's piece is a DTensor; full_tensor() gives the whole gradient's
    grads = [norm.full_tensor() if hasattr(norm, "full_tensor") else norm for norm in grads]
    return torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.zeros(())


def per_layer_grad_norms(raw_model):
    """The gradient norm of the embeddings (grad/embedding) and of each block (grad/layerNN), to
    find which layer blows up. The model says which parameters are embeddings and which modules are
    its blocks."""
    norms = {"grad/embedding": grad_norm(raw_model.param_groups()["embedding"])}
    for i, block in enumerate(raw_model.blocks):
        norms[f"grad/layer{i:02d}"] = grad_norm(block.parameters())
    return norms


def make_profiler(cfg):
    """torch.profiler over one window of steps (log.profile_wait, _warmup, _active), on rank 0; the
    trace (chrome://tracing, Perfetto, TensorBoard) lands in <out_dir>/profiler/."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    log = cfg.log
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=log.profile_wait, warmup=log.profile_warmup,
                                         active=log.profile_active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(os.path.join(cfg.train.out_dir,
                                                                             "profiler"),
                                                               worker_name="rank0"),
    )
