"""Every config field's declared role (config.py: identity, applied, free), checked on a real resume.

A run trains to step 2 and saves a checkpoint; each test resumes a copy of it with other settings:
- every `identity` field changed alone is refused in one sentence naming it, and nothing is written;
- all `applied` fields changed at once train exactly as a fresh run that loads the same checkpoint
  with the same values (the optimizer uses the config in force, not the checkpoint's settings);
- all `free` fields changed at once leave every training loss bit for bit as it was.
The roles come from the declarations (config.py, model.py's GPTConfig). Each field is changed to a value
derived from its declaration (changed_value: the other bool, another word, a number moved inside its declared
range), or, where a value must name something real or fit the others, to the one the tables below choose; so
a new setting needs no line here unless it is a string or a list.
"""

import os
import shutil
from pathlib import Path

import pytest

import torch

from conftest import TINY, read_metrics, run_train, tiny_task_data
from config import (ROLES, Config, all_keys, field_metadata, field_type, get, keys_with_role, literal_choices,
                    parse_args)

# The run being resumed: stage 2 is on (from step 3) so its fields can change too.
BASE = ["--train.max_steps=6", "--train.hard_stop=2", "--optim.warmup_steps=1", "--stage2.start=3steps",
        "--stage2.kl_beta=0.1", "--checkpoint.interval=2"]

# Chosen values: names of real things (datasets, files, sources), and values that must fit the others when a whole
# role changes at once (wsds periods that add up to the run, a batch that divides the total).
CHOSEN_IDENTITY = {
    "model.block_size": 16, "model.vocab_size": 50257, "model.n_layer": 3, "model.n_head": 4, "model.n_embd": 64,
    "model.bias": False, "data.dataset": "python", "data.shuffle": False, "data.mix": ["shakespeare:1"],
    "train.total_batch_size": 256, "train.seed": 7, "optim.name": "muon", "optim.decay_embeddings": False,
    "stage2.start": "4steps", "stage2.mix": ["shakespeare:1"], "stage2.reference": "SOURCE",
    "train.model_module": "MODULE",
}
CHOSEN_APPLIED = {
    "model.dropout": 0.1, "data.batch_size": 2, "train.max_steps": 7, "train.max_duration": "7steps",
    "train.device": "cpu", "train.dtype": "bfloat16", "train.compile": "false", "train.loss_path": "full",
    "train.steps_to_skip": "5-6", "train.nan_policy": "skip", "train.nan_skip_limit": 3,
    "train.deterministic": True, "optim.lr": 2e-3, "optim.min_lr": 1e-4, "optim.schedule": "wsds",
    "optim.warmup_steps": 0, "optim.warmup_fraction": 0.25, "optim.decay_steps": 1, "optim.decay_fraction": 0.5,
    "optim.decay_shape": "cosine", "optim.periods": [4, 3], "optim.period_lr_multipliers": [1.0, 0.5],
    "optim.weight_decay": 0.05, "optim.beta1": 0.8, "optim.beta2": 0.9, "optim.eps": 1e-6, "optim.grad_clip": 0.5,
    "optim.muon_lr": 0.01, "optim.muon_weight_decay": 0.05, "optim.muon_momentum": 0.9, "eval.val_steps": 1,
    "eval.tasks_limit": 5, "stage2.kl_beta": 0.5, "stage2.kl_estimator": "full",
}
CHOSEN_FREE = {
    "data.data_root": "LINK", "train.peak_flops": 1e12, "train.hard_stop": "10steps", "train.time_limit": 1000.0,
    "train.loss_spike_threshold": 2.0, "train.gc_interval": 3, "train.dist_timeout": 60.0,
    "train.cancel_check_interval": 2, "eval.interval": 1, "eval.sample_interval": 2, "eval.num_samples": 1,
    "eval.sample_tokens": 4, "eval.sample_prompt": "To be", "eval.sample_temperature": 1.0, "eval.sample_top_k": 5,
    "eval.fixed_steps": [4], "eval.tasks": ["copa"], "eval.tasks_interval": 3, "eval.tasks_data_dir": "TASKS",
    "eval.tasks_batch_size": 8, "eval.extra_datasets": ["shakespeare"], "log.interval": 2,
    "log.metrics_collect_interval": 2, "log.async_bookkeeping": True, "log.grad_norms_interval": 1,
    "log.slack_webhook": "http://127.0.0.1:9/nobody", "log.wandb_project": "p", "log.wandb_name": "n",
    "log.wandb_group": "g", "log.wandb_tags": ["t"], "log.wandb_cancel_tags": ["stop"],
    "log.profile": True, "log.profile_wait": 0, "log.profile_warmup": 0, "log.profile_active": 1,
    "checkpoint.interval": 1, "checkpoint.keep_last": 1, "checkpoint.ephemeral_interval": 1,
    "checkpoint.fixed_steps": [4], "checkpoint.async_save": True, "checkpoint.load": "always",
    "checkpoint.load_path": "SOURCE", "checkpoint.load_optim": False, "checkpoint.load_trainer_state": False,
    "checkpoint.save_overwrite": True, "checkpoint.remote_folder": "BUCKET", "checkpoint.resume_step": 2,
    "checkpoint.rewind_number": 2,
    "debug.trace_steps": [4], "debug.trace_sequences": 2,
}
FREE_OFF = {"train.no_evals": True}  # a second resume: evaluation off
NOT_CHANGED = {  # free fields no resume test changes, and why
    "train.out_dir": "it is the folder being resumed",
    "log.wandb": "it starts W&B's service; tests/test_metrics.py runs it offline",
    "train.no_checkpoints": "it loads no checkpoint, so there is no resume to compare (test_from_the_references.py)",
    "train.data_parallel": "fsdp needs torchrun; test_fsdp.py resumes a DDP run as FSDP and an FSDP run on 1 process",
}


def changed_value(key):
    """Another valid value for `key`, from its declaration: the other bool, another of its words, or a number
    moved inside its declared range check. None for a string or a list, which must name something real."""
    cfg = Config()
    default, type_, check = get(cfg, key), field_type(cfg, key), field_metadata(cfg, key).get("check")
    if type_ is bool:
        return not default
    if literal_choices(type_):
        return next(word for word in literal_choices(type_) if word != default)
    if type_ is float and check in ("in [0, 1)", "in [0, 1]"):
        return (default + 1) / 2
    if type_ in (int, float):  # "at least 1", "0 or more", "greater than 0", or no check: all stay in range
        return default * 2 if default else type_(1)
    return None


def values_for(role, chosen, leave_out=()):
    return {key: chosen.get(key, changed_value(key)) for key in keys_with_role(role) if key not in leave_out}


IDENTITY = values_for("identity", CHOSEN_IDENTITY)
APPLIED = values_for("applied", CHOSEN_APPLIED)
FREE = values_for("free", CHOSEN_FREE, leave_out=[*FREE_OFF, *NOT_CHANGED])


def test_every_field_declares_a_role_and_gets_a_value_to_change_to():
    cfg = Config()
    assert all(field_metadata(cfg, key)["role"] in ROLES for key in all_keys(cfg))
    unchanged = [key for key, value in {**IDENTITY, **APPLIED, **FREE}.items() if value is None]
    assert unchanged == [], f"add {unchanged} to a CHOSEN table above: a string or list must name something real"
    assert set(IDENTITY) | set(APPLIED) | set(FREE) | set(FREE_OFF) | set(NOT_CHANGED) == set(all_keys(cfg))


def overrides(values, data_root, source):
    def text(value):
        if isinstance(value, str):
            value = {"SOURCE": source, "LINK": data_root + "_link", "TASKS": tiny_task_data(),
                     "BUCKET": f"file://{data_root}_bucket",
                     "MODULE": str(Path(__file__).parent / "gpt_of_your_own.py")}.get(value, value)
        if isinstance(value, list):
            return ",".join(map(str, value))
        return str(value).lower() if isinstance(value, bool) else str(value)
    return [f"--{key}={text(value)}" for key, value in values.items()]


@pytest.fixture(scope="module")
def source(data_root, tmp_path_factory):
    """A run trained to step 2 (its checkpoint), and a second name for the data root."""
    out = tmp_path_factory.mktemp("roles") / "source"
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", *BASE])
    if not os.path.exists(f"{data_root}_link"):
        os.symlink(data_root, f"{data_root}_link")
    return out


def resume(source, tmp_path, name, data_root, *extra, check=True):
    out = tmp_path / name
    shutil.copytree(source, out, symlinks=True)
    return out, run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", *BASE[:1],
                                  *BASE[2:], "--train.hard_stop=", *extra], check=check)


def after_step_2(run):
    return [r for r in read_metrics(run) if r["step"] > 2]


def snapshot(folder):
    return {os.path.relpath(os.path.join(d, f), folder): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, files in os.walk(folder) for f in files}


@pytest.mark.parametrize("key", sorted(IDENTITY))
def test_a_changed_identity_field_is_refused_before_anything_is_written(key, source, data_root, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(source, out, symlinks=True)
    before, data_before = snapshot(out), sorted(os.listdir(data_root))
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", *BASE[:1], *BASE[2:],
                               *overrides({key: IDENTITY[key]}, str(data_root), str(source / "step2"))],
                       check=False)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert key in result.stderr and result.stderr.count("error:") == 1
    assert snapshot(out) == before  # no checkpoint moved, no config or metrics written
    assert sorted(os.listdir(data_root)) == data_before  # no dataset prepared (data.dataset=python)


def test_changed_applied_fields_train_as_a_fresh_run_that_loads_the_checkpoint(source, data_root, tmp_path):
    changed = overrides(APPLIED, str(data_root), str(source / "step2"))
    resumed, _ = resume(source, tmp_path, "resumed", data_root, *changed)
    loaded = tmp_path / "loaded"
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={loaded}", *BASE[:1], *BASE[2:],
                      f"--checkpoint.load_path={source / 'step2'}", *changed])
    a, b = [r for r in read_metrics(resumed) if r["step"] > 2], read_metrics(loaded)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [3, 4, 5, 6, 7]
    for key in ("train/loss", "train/grad_norm", "optim/lr/adamw", "optim/lr/adamw_no_decay", "tokens", "val/loss"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    assert "train/loss" not in a[2] and a[2]["train/skipped_data_step"] == 1.0  # steps_to_skip=5-6 applied


def test_the_optimizer_uses_the_config_in_force_after_a_resume(source, data_root, tmp_path):
    """What build_run hands the loop: every group setting is the new config's, none the checkpoint's."""
    import contextlib

    import train
    from optimizer import build_optimizer

    out = tmp_path / "run"
    shutil.copytree(source, out, symlinks=True)
    changed = {key: APPLIED[key] for key in APPLIED if key.startswith("optim.") and "period" not in key
               and key not in ("optim.schedule", "optim.decay_steps", "optim.decay_fraction", "optim.decay_shape")}
    cfg = parse_args(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", *BASE[:1], *BASE[2:],
                             *overrides(changed, str(data_root), "")])
    with contextlib.ExitStack() as stack:
        run = train.build_run(cfg, stack)
        assert run.resumed and run.state.step == 2
        fresh = build_optimizer(run.raw_model, cfg.optim, run.place.kind.fused_optimizer)
        in_force = [{k: v for k, v in g.items() if k != "params"} for g in run.optimizer.param_groups]
        assert in_force == [{k: v for k, v in g.items() if k != "params"} for g in fresh.param_groups]
        assert in_force[0]["peak_lr"] == 2e-3 and in_force[0]["weight_decay"] == 0.05
        assert in_force[0]["betas"] == (0.8, 0.9) and in_force[0]["eps"] == 1e-6
        assert any(torch.is_tensor(s.get("exp_avg")) for s in run.optimizer.state.values())  # the moments loaded


def test_changed_free_fields_change_no_training_value(source, data_root, tmp_path):
    plain, _ = resume(source, tmp_path, "plain", data_root)
    free, _ = resume(source, tmp_path, "free", data_root, *overrides(FREE, str(data_root), str(source / "step2")))
    off, _ = resume(source, tmp_path, "off", data_root, *overrides(FREE_OFF, str(data_root), ""))
    want = [(r["step"], r["train/loss"], r["train/grad_norm"], r["optim/lr"]) for r in after_step_2(plain)]
    assert [s for s, *_ in want] == [3, 4, 5, 6]
    for run in (free, off):
        assert [(r["step"], r["train/loss"], r["train/grad_norm"], r["optim/lr"]) for r in after_step_2(run)] == want
    rows = after_step_2(free)
    assert "eval/copa/acc" in rows[0] and "val/shakespeare/loss" in rows[0] and "grad/layer00" in rows[0]
    assert (free / "samples.txt").exists() and (free / "traces" / "step4").exists()
