"""The run's plan: how long it is, how a step splits into micro-steps, and what is due after each step.

`make_plan(cfg, ...)` resolves the config into a `Plan` once, before anything is written. The loop
then asks `plan.due(step)` after every step, `--dry_run` prints the same plan, and the model ladder
lists the checkpoints a size will keep from it: one rule for everything periodic.

The cadence rule, the same for validation, tasks, samples, checkpoints, traces and collecting metrics: a thing is due
every `interval` steps and at the run's last step, and at its fixed steps; an interval of 0 means
"at its fixed steps only" (none: never). The last step is the end of the run, so the final evaluation and
checkpoint reuse the periodic code; an early stop (signal, CANCEL, time limit) runs only the checkpoint, since a
scheduler's grace period is short. The final checkpoint is always written (a run that stops must be resumable),
unless `train.no_checkpoints`.
"""

from dataclasses import dataclass

from config import ConfigError, check_warmup, duration_to_steps, in_ranges, parse_step_ranges


@dataclass(frozen=True)
class Every:
    """Every `interval` steps and at the last step (interval 0: not periodically), and at `fixed` steps."""
    interval: int = 0
    fixed: tuple = ()

    def due(self, step, last=False):
        return step in self.fixed or (self.interval > 0 and step > 0 and (step % self.interval == 0 or last))


@dataclass(frozen=True)
class Due:
    """What runs after a step, in the loop's order."""
    val: bool = False  # validation losses
    tasks: bool = False  # downstream tasks (HellaSwag is one of them)
    checkpoint: str | None = None  # the kind of checkpoint to save: fixed, permanent, ephemeral, or None
    sample: bool = False  # text samples (rank 0)
    # metrics to the host and the sinks (always before a checkpoint: metrics.jsonl is then complete)
    collect: bool = False

    @property
    def evals(self):
        return self.val or self.tasks

    @property
    def output(self):
        """Anything that reads the model's state: the moment to check that the loss is finite."""
        return self.evals or self.sample or bool(self.checkpoint)


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
    ephemeral_cooldown: int  # an ephemeral checkpoint this soon after a fixed or permanent one is skipped
    traces: Every  # debug.trace_steps: fixed steps only
    metrics: Every  # log.metrics_collect_interval: one sync and one collective each time
    grad_norms: Every  # log.grad_norms_interval: per-layer gradient norms
    activations: Every  # log.activations_interval: activation statistics and parameter norms
    no_checkpoints: bool
    skipped: tuple = ()  # train.steps_to_skip as (start, end) ranges of steps whose data is read but not trained on

    def skips_data(self, step):
        return in_ranges(step, self.skipped)

    def due(self, step, last=False, stop=False):
        """What runs after `step`; `last` at the run's end. On an early stop (signal, CANCEL, time limit) only
        the checkpoint: a scheduler's grace period is short, and an evaluation could eat it."""
        if stop and not last:
            checkpoint = None if self.no_checkpoints else "permanent"
            return Due(checkpoint=checkpoint, collect=True)
        checkpoint = self.checkpoint_kind(step, last)
        return Due(val=self.val.due(step, last), tasks=self.tasks.due(step, last), checkpoint=checkpoint,
                   sample=self.samples.due(step, last), collect=self.metrics.due(step, last) or bool(checkpoint))

    def checkpoint_kind(self, step, last=False):
        if self.no_checkpoints:
            return None
        if step in self.fixed_checkpoints:
            return "fixed"
        if last or self.checkpoints.due(step):
            return "permanent"
        if not self.ephemeral.due(step):
            return None
        recent = range(max(1, step - self.ephemeral_cooldown + 1), step)  # OLMo-core's ephemeral_cooldown
        return None if any(s in self.fixed_checkpoints or self.checkpoints.due(s) for s in recent) else "ephemeral"

    def checkpoint_steps(self):
        """Every step a checkpoint will be saved at if the run is not stopped early (step 0 included)."""
        return [s for s in range(0 if 0 in self.fixed_checkpoints else 1, self.end_step + 1)
                if self.checkpoint_kind(s, last=s == self.end_step)]


def make_plan(cfg, world_size, tokens_per_epoch, non_embedding_params):
    """The Plan of a run; a batch that does not divide, or a stage 2 that never begins, is one sentence."""
    t = cfg.train
    tokens_per_micro_step = cfg.data.batch_size * cfg.model.block_size * world_size
    if t.total_batch_size % tokens_per_micro_step:
        raise ConfigError(
            f"train.total_batch_size={t.total_batch_size} is not a multiple of data.batch_size x model.block_size "
            f"x world_size = {cfg.data.batch_size} x {cfg.model.block_size} x {world_size} = "
            f"{tokens_per_micro_step}; change one of them so it divides.")

    def steps(duration, key):
        return duration_to_steps(duration, t.total_batch_size, tokens_per_epoch, non_embedding_params, key=key)

    max_steps = steps(t.max_duration, "train.max_duration") if t.max_duration else t.max_steps
    end_step = min(max_steps, steps(t.hard_stop, "train.hard_stop")) if t.hard_stop else max_steps
    stage2_step = steps(cfg.stage2.start, "stage2.start") if cfg.stage2.start else None
    if stage2_step is not None and stage2_step >= max_steps:
        raise ConfigError(f"stage2.start={cfg.stage2.start} is step {stage2_step}, not before the run's end at "
                          f"step {max_steps}; start stage 2 earlier or train longer.")
    check_warmup(cfg.optim.warmup_steps, max_steps)
    e, c = cfg.eval, cfg.checkpoint
    if e.tasks and not (e.tasks_interval or e.fixed_steps):  # here, not in config.py: the ladder sets fixed_steps
        raise ConfigError(f"eval.tasks={','.join(e.tasks)} would never run: set eval.tasks_interval (every N steps "
                          f"and at the end) or eval.fixed_steps (at those steps only).")
    evals = not t.no_evals  # train.no_evals: no validation, tasks or samples (OLMo-core's switch, for benchmarks)
    never = Every()
    return Plan(
        grad_accum_steps=t.total_batch_size // tokens_per_micro_step, tokens_per_step=t.total_batch_size,
        max_steps=max_steps, end_step=end_step, stage2_step=stage2_step,
        val=Every(e.interval, tuple(e.fixed_steps)) if evals else never,
        tasks=Every(e.tasks_interval, tuple(e.fixed_steps)) if evals and e.tasks else never,
        samples=Every(e.sample_interval) if evals else never,
        checkpoints=Every(c.interval),
        fixed_checkpoints=tuple(c.fixed_steps) + ((stage2_step,) if stage2_step is not None else ()),
        ephemeral=Every(c.ephemeral_interval), ephemeral_cooldown=c.ephemeral_cooldown,
        traces=Every(0, tuple(cfg.debug.trace_steps)),
        metrics=Every(cfg.log.metrics_collect_interval), grad_norms=Every(cfg.log.grad_norms_interval),
        activations=Every(cfg.log.activations_interval),
        no_checkpoints=t.no_checkpoints, skipped=tuple(parse_step_ranges(t.steps_to_skip)))
