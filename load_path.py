"""checkpoint.load_path, checked when the run starts. A module of its own so that `import train` does not load it:
train.main imports it only for a run that sets checkpoint.load_path (fine-tuning GPT-2, starting from another run).
"""

import os

from checkpoint import check_source, newest_checkpoint, read_trainer_state
from config import ConfigError, with_defaults
from lab.hf import gpt2_shape, is_gpt2_source, use_source_shape


def use_load_path_shape(cfg, default_config):
    """Before anything is written: a GPT-2 gives the model its shape, and a path that is neither a folder nor a
    GPT-2 name is one sentence (a typo would train from scratch). A run that already has its own checkpoint of the
    same load_path resumes it: the shape is the checkpoint's, and the source is not needed any more (a deleted
    folder, a hub name offline)."""
    ck = cfg.checkpoint
    own = newest_checkpoint(cfg.train.out_dir) if ck.load != "never" else None
    saved = read_trainer_state(own)["config"] if own else None
    if saved is None and ck.remote_folder and ck.load != "never":  # a fresh node: the run's own is in the bucket
        from lab import remote
        bucket_config, bucket_steps = remote.read_run(ck.remote_folder)
        saved = with_defaults(bucket_config) if bucket_steps and bucket_config else None  # fields added since: defaults
    if saved:  # a run resumes its own checkpoint, whose shape it has, whatever load_path says now
        use_source_shape(saved["model"], cfg.model, saved["checkpoint"].get("load_path"), "the run's own checkpoint",
                         default_config)
    elif is_gpt2_source(ck.load_path):
        check_source(ck.load_path, "checkpoint.load_path")
        if cfg.train.data_parallel == "fsdp":  # (hf.load_gpt2_weights copies whole tensors into the model)
            raise ConfigError(f"checkpoint.load_path={ck.load_path} is GPT-2's weights, which load into a whole model, "
                              f"and train.data_parallel=fsdp shards it; fine-tune with --train.data_parallel=ddp.")
        use_source_shape(gpt2_shape(ck.load_path), cfg.model, ck.load_path, "a GPT-2", default_config)
    elif not os.path.isdir(ck.load_path):
        check_source(ck.load_path, "checkpoint.load_path")
