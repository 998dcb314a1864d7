"""Weights & Biases (log.wandb): starting or resuming a run's W&B run. A module of its own so that a run without
W&B loads none of it; metrics.py's `Sinks` imports it when log.wandb is on, and logs the rows to the run it returns.
"""

import os
import sys
import uuid

from config import redact_argv


def start_wandb(out_dir, log_cfg, config_dict):
    """Start or resume this run's W&B run. The run id is kept in <out_dir>/wandb_id.txt, so a restart
    logs into the same run. WANDB_MODE=offline writes it under <out_dir>/wandb/ for a later sync."""
    import wandb

    id_path = os.path.join(out_dir, "wandb_id.txt")
    if os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:8]  # W&B run ids are short lowercase strings
        with open(id_path, "w") as f:
            f.write(run_id)
    # W&B records the command line (sys.argv) in its run's metadata and logs: it reads the one with secrets redacted
    # (config.redact_argv), as `config_dict` holds them redacted (config.config_to_dict).
    argv, sys.argv = sys.argv, redact_argv(sys.argv)
    try:
        return wandb.init(
            project=log_cfg.wandb_project,
            name=log_cfg.wandb_name or os.path.basename(os.path.abspath(out_dir)),
            group=log_cfg.wandb_group or None,
            tags=log_cfg.wandb_tags or None,
            id=run_id,
            resume="allow",
            dir=out_dir,
            config=config_dict,
        )
    finally:
        sys.argv = argv
