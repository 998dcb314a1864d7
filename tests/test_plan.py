"""The run's plan (plan.py): lengths, micro-steps, and the one cadence rule for everything periodic."""

import pytest

from config import ConfigError, parse_args
from conftest import TINY, read_metrics, run_train
from plan import Every, make_plan


def plan_of(*overrides, world_size=1, tokens_per_epoch=10_000, non_embedding=1000):
    cfg = parse_args(["--model.block_size=32", "--data.batch_size=4", "--train.total_batch_size=256",
                      "--train.max_steps=20", "--optim.warmup_steps=5", *overrides])
    return make_plan(cfg, world_size, tokens_per_epoch, non_embedding)


def test_every_interval_also_fires_at_the_last_step_and_at_fixed_steps():
    every = Every(5, (3,))
    assert [s for s in range(0, 13) if every.due(s, last=s == 12)] == [3, 5, 10, 12]
    assert not every.due(0)  # step 0 (before training) only when it is a fixed step


def test_an_interval_of_zero_means_fixed_steps_only_and_none_means_never():
    assert [s for s in range(0, 11) if Every(0, (0, 4)).due(s, last=s == 10)] == [0, 4]
    assert not any(Every().due(s, last=True) for s in range(0, 11))


def test_the_plan_splits_a_step_into_micro_steps_per_rank():
    assert plan_of().grad_accum_steps == 2  # 256 tokens = 2 micro-steps of 4 x 32
    assert plan_of(world_size=2).grad_accum_steps == 1
    with pytest.raises(ConfigError, match="not a multiple of data.batch_size x model.block_size x world_size"):
        plan_of(world_size=3)


def test_durations_and_a_hard_stop_set_the_lengths():
    plan = plan_of("--train.max_duration=2epochs", "--train.hard_stop=3000tokens")
    assert (plan.max_steps, plan.end_step) == (79, 12)  # 20,000 / 256 rounded up; 3,000 / 256 rounded up


def test_each_periodic_thing_follows_its_own_settings():
    plan = plan_of("--eval.interval=5", "--eval.fixed_steps=0,7", "--eval.sample_interval=10", "--eval.tasks=copa",
                   "--eval.tasks_interval=0", "--checkpoint.interval=8", "--checkpoint.fixed_steps=3",
                   "--checkpoint.ephemeral_interval=2", "--debug.trace_steps=4")
    due = {s: plan.due(s, last=s == 20) for s in range(0, 21)}
    assert [s for s, d in due.items() if d.val] == [0, 5, 7, 10, 15, 20]
    assert [s for s, d in due.items() if d.tasks] == [0, 7]  # tasks_interval 0: eval.fixed_steps only
    assert [s for s, d in due.items() if d.sample] == [10, 20]
    kinds = {s: d.checkpoint for s, d in due.items() if d.checkpoint}
    assert kinds == {2: "ephemeral", 3: "fixed", 4: "ephemeral", 6: "ephemeral", 8: "permanent", 10: "ephemeral",
                     12: "ephemeral", 14: "ephemeral", 16: "permanent", 18: "ephemeral", 20: "permanent"}
    assert [s for s in range(1, 21) if plan.traces.due(s)] == [4]
    assert plan.checkpoint_steps() == sorted(kinds)  # what --dry_run and the ladder list


def test_an_early_stop_is_a_last_step_and_the_final_checkpoint_is_always_kept():
    plan = plan_of("--eval.interval=5", "--checkpoint.interval=0")
    early = plan.due(7, last=True)  # a signal after step 7
    assert early.val and early.checkpoint == "permanent"
    assert plan.due(7).checkpoint is None and plan.due(20, last=True).checkpoint == "permanent"


def test_the_stage2_boundary_is_a_fixed_checkpoint_and_switches_turn_things_off():
    plan = plan_of("--stage2.start=6steps")
    assert plan.stage2_step == 6 and plan.due(6).checkpoint == "fixed"
    off = plan_of(
        "--train.no_evals=true", "--train.no_checkpoints=true", "--eval.interval=1", "--eval.sample_interval=1"
    )
    assert not any(due.evals or due.sample or due.checkpoint for due in map(off.due, range(1, 21)))
    with pytest.raises(ConfigError, match="stage2.start=30steps is step 30, not before the run's end at step 20"):
        plan_of("--stage2.start=30steps")


def test_skipped_data_steps_are_the_plans_to_say():
    plan = plan_of("--train.steps_to_skip=3-5,10-11")
    assert [s for s in range(1, 21) if plan.skips_data(s)] == [3, 4, 10]


def test_a_warmup_longer_than_the_run_is_refused():
    with pytest.raises(ConfigError, match="optim.warmup_steps=21 is longer than the run"):
        plan_of("--optim.warmup_steps=21")
    assert plan_of("--optim.warmup_steps=20").max_steps == 20  # the last step reaches the peak


def test_an_early_stop_saves_a_checkpoint_first_and_evaluates_nothing():
    plan = plan_of("--eval.interval=5", "--eval.sample_interval=5", "--checkpoint.interval=5")
    assert plan.due(5).val and plan.due(5).sample  # what step 5 runs when nothing stops the run
    stopped = plan.due(5, stop=True)
    assert stopped.checkpoint == "permanent" and stopped.write_metrics
    assert not (stopped.val or stopped.tasks or stopped.sample)
    assert plan.due(20, last=True, stop=True).val  # a stop at the run's last step is just the end
    assert plan_of("--train.no_checkpoints=true").due(7, stop=True).checkpoint is None


def test_an_ephemeral_checkpoint_is_skipped_within_its_cooldown_after_a_fixed_or_permanent_one():
    """OLMo-core's ephemeral_cooldown: its ladder saves ephemeral checkpoints every 1,000 steps except within 250
    steps of a fixed one."""
    cfg = parse_args(["--train.max_steps=100", "--checkpoint.interval=40", "--checkpoint.fixed_steps=25",
                      "--checkpoint.ephemeral_interval=10", "--checkpoint.ephemeral_cooldown=6"])
    plan = make_plan(cfg, world_size=1, tokens_per_epoch=10**9, non_embedding_params=10**6)
    kinds = {s: plan.due(s, last=s == 100).checkpoint for s in plan.checkpoint_steps()}
    assert [s for s, kind in kinds.items() if kind == "ephemeral"] == [10, 20, 50, 60, 70, 90]  # 30 after 25, 40 is
    assert kinds[25] == "fixed" and kinds[40] == kinds[80] == kinds[100] == "permanent"          # permanent, ...


def test_the_memory_estimate_counts_what_each_rank_holds_with_ddp_and_with_fsdp():
    import torch

    from model import GPT, GPTConfig
    from plan import describe_memory, memory_per_rank

    with torch.device("meta"):
        gpt2 = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024), "chunked")
    n = gpt2.num_params()
    one = memory_per_rank(gpt2, 1024, 1, False, True, "cuda")
    assert (one["weights"], one["gradients"], one["optimizer"]) == (6 * n, 4 * n, 8 * n)  # fp32 + autocast's bf16
    ddp = memory_per_rank(gpt2, 1024, 8, False, True, "cuda")
    assert ddp["gradients"] == 8 * n and ddp["activations"] == one["activations"]  # DDP's buckets: a second copy
    fsdp = memory_per_rank(gpt2, 1024, 8, True, True, "cuda")
    assert fsdp["optimizer"] == n and fsdp["weights"] < ddp["weights"] / 4 and fsdp["total"] < ddp["total"] / 2
    # 34 x width bytes per token and layer in bf16 (Korthikanti et al. 2022), then the output layer's logits: the
    # full path holds them all, the chunked one a slice at a time
    with torch.device("meta"):
        full = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024), "full")
    many = [memory_per_rank(m, 16 * 1024, 1, False, True, "cuda")["activations"] for m in (gpt2, full)]
    assert 34 * 768 * 12 * 16384 < many[0] < many[1] == 34 * 768 * 12 * 16384 + 3 * 16384 * 50304 * 4
    line = describe_memory(gpt2, 1024, 8, True, "cuda")
    assert line.startswith("memory per rank (estimate): weights") and "with FSDP on 8 rank(s)" in line


@pytest.mark.parametrize("hard_stop", ["3", "3steps", "384tokens"])
def test_hard_stop_takes_a_duration_and_a_bare_number_is_steps(data_root, tmp_path, hard_stop):
    out = tmp_path / "run"
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=10",
                      f"--train.hard_stop={hard_stop}", "--eval.interval=0"])  # 128 tokens per step
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["optim/lr"] > 0.1 * rows[0]["optim/lr"]  # the schedule still runs to step 10
