"""A model's weights from wherever they are: a run folder, a checkpoint, an OpenAI GPT-2 name or a Hugging Face
folder. What reads a finished model calls `load_model` (sample.py, hellaswag_eval.py, stage 2's reference,
export-hf); a run that starts from checkpoint.load_path checks its source and takes its shape here first.
`python checkpoint.py list | export-hf` are `commands` below. A training run that starts from nothing, or resumes
its own checkpoints, never loads this file: `import train` does not.
"""

import argparse
import os

from checkpoint import (CheckpointError, UntrustedCheckpoint, find_checkpoints, is_complete_checkpoint,
                        load_model_state, newest_checkpoint, newest_valid_checkpoint, read_marker, read_trainer_state,
                        verify_checkpoint)
from config import config_from_dict, with_defaults
from model import gpt_class


def resolve_checkpoint(source):
    """A checkpoint folder, or a run folder (its newest valid checkpoint)."""
    if is_complete_checkpoint(source):
        try:
            verify_checkpoint(source)
        except UntrustedCheckpoint:
            raise
        except CheckpointError as error:
            raise CheckpointError(f"{error}; give the run folder instead to fall back to its newest good "
                                  f"checkpoint.") from None
        return source
    path = newest_valid_checkpoint(source)
    if path is None:
        raise CheckpointError(f"no complete checkpoint at {source}; give a step<N> folder or a run folder "
                              f"that holds one.")
    return path


def is_gpt2(source):
    """An OpenAI GPT-2 name or a local Hugging Face folder (hf.py): weights to start from, not a checkpoint of ours."""
    from hf import is_gpt2_source
    return is_gpt2_source(source)


def check_source(source, key):
    """Raise one sentence naming `key` (the setting or flag the source came from) unless `source` is a model
    that load_model can load: a run or checkpoint folder holding a valid checkpoint, a local HF GPT-2 folder,
    or an OpenAI GPT-2 name (then transformers must be installed). Returns the checkpoint folder, or None.
    Cheap: no weights read, except from a bucket (an s3:// or gs:// URL), downloaded once into a cache."""
    from hf import OPENAI_MODELS, is_hf_folder
    if "://" in source:  # a bucket (remote.py): the local copy is checked as any checkpoint folder is
        import remote
        return resolve_checkpoint(remote.local_copy(source, key))
    if source in OPENAI_MODELS:
        import importlib.util
        if importlib.util.find_spec("transformers") is None:
            raise CheckpointError(f"{key}={source} is loaded with the transformers package, which is not installed; "
                                  f"pip install transformers, or give a run folder.")
        return None
    if is_hf_folder(source):
        return None
    if not os.path.isdir(source):
        raise CheckpointError(f"{key}={source} is not a folder nor one of {', '.join(OPENAI_MODELS)}; give a "
                              f"run folder, a step<N> checkpoint folder, a GPT-2 name or a HF GPT-2 folder.")
    try:
        return resolve_checkpoint(source)
    except CheckpointError as error:
        if any(os.path.exists(os.path.join(source, name)) for name in ("model.safetensors", "pytorch_model.bin")):
            raise CheckpointError(f"{key}={source} holds Hugging Face weights but no readable config.json with a "
                                  f"model_type; save the model again with save_pretrained.") from None
        if os.path.exists(os.path.join(source, "config.json")) and not find_checkpoints(source):
            raise CheckpointError(f"{key}={source} holds a config.json but no weights (no checkpoint of this trainer, "
                                  f"no model.safetensors or pytorch_model.bin); give a folder that holds weights.") \
                from None
        raise CheckpointError(f"{key}: {error}") from None


def load_model(source, device, key):
    """A GPT from a SOURCE: a run folder (its newest valid checkpoint), a checkpoint folder, an OpenAI GPT-2
    name (gpt2 ... gpt2-xl, via transformers) or a local HF GPT-2 folder. A checkpoint of ours is loaded
    into the GPT class it was trained with (train.model_module). Errors name `key`, the setting or flag the
    source came from (sample.py's --init_from, stage2.reference, ...)."""
    path = check_source(source, key)
    if path is None:
        from hf import import_hf
        return import_hf(source).to(device).eval()
    cfg = config_from_dict(read_trainer_state(path)["config"])
    try:
        model = gpt_class(cfg.train.model_module)(cfg.model)
    except ValueError as error:  # a train.model_module file that is gone or changed
        raise CheckpointError(f"{key}={source}: {error}") from None
    load_model_state(model, path, "cpu")
    return model.to(device).eval()


def commands(argv):
    parser = argparse.ArgumentParser(description="List a run's checkpoints, or export one as a Hugging Face GPT-2.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the complete checkpoints of a run").add_argument("run_dir")
    export = commands.add_parser("export-hf", help="a Hugging Face GPT-2 folder (see hf.py)")
    export.add_argument("checkpoint", help="a step<N> folder or a run folder (its newest valid checkpoint)")
    export.add_argument("out_dir")
    args = parser.parse_args(argv)
    if args.command == "list":
        if not os.path.isdir(args.run_dir):
            raise CheckpointError(f"{args.run_dir} is not a folder; give the train.out_dir of a run.")
        # A step<N> folder lists itself; each is verified as the loader verifies it (every file's checksum).
        found = [(read_marker(args.run_dir)["step"], args.run_dir)] if is_complete_checkpoint(args.run_dir) \
            else find_checkpoints(args.run_dir)
        if not found:
            raise CheckpointError(f"{args.run_dir} holds no complete checkpoint; give the train.out_dir of a run "
                                  f"that saved one, or one of its step<N> folders.")
        for step, path in found:
            try:
                verify_checkpoint(path)
                state = "complete"
            except CheckpointError as error:
                state = f"damaged: {error}"
            print(f"step {step:>8}  {read_marker(path).get('kind', '?'):<9}  {path}  {state}")
    else:
        from hf import check_export_target, export_hf
        check_export_target(args.out_dir)  # before the (slow) load
        export_hf(load_model(args.checkpoint, "cpu", "export-hf's CHECKPOINT"), args.out_dir)


def use_load_path_shape(cfg, default_config):
    """checkpoint.load_path, checked before anything is written: a GPT-2 gives the model its shape (fine-tuning),
    and a path that is neither a folder nor a GPT-2 name is one sentence (a typo would train from scratch).
    A run that already has its own checkpoint of the same load_path resumes it: the shape is the checkpoint's,
    and the source is not needed any more (a deleted folder, a hub name offline)."""
    from hf import gpt2_shape, is_gpt2_source, use_source_shape

    ck = cfg.checkpoint
    own = newest_checkpoint(cfg.train.out_dir) if ck.load != "never" else None
    saved = read_trainer_state(own)["config"] if own else None
    if saved is None and ck.remote_folder and ck.load != "never":  # a fresh node: the run's own is in the bucket
        import remote
        bucket_config, bucket_steps = remote.read_run(ck.remote_folder)
        saved = with_defaults(bucket_config) if bucket_steps and bucket_config else None  # fields added since: defaults
    if saved:  # a run resumes its own checkpoint, whose shape it has, whatever load_path says now
        use_source_shape(saved["model"], cfg.model, saved["checkpoint"].get("load_path"), "the run's own checkpoint",
                         default_config)
    elif is_gpt2_source(ck.load_path):
        check_source(ck.load_path, "checkpoint.load_path")
        use_source_shape(gpt2_shape(ck.load_path), cfg.model, ck.load_path, "a GPT-2", default_config)
    elif not os.path.isdir(ck.load_path):
        check_source(ck.load_path, "checkpoint.load_path")
