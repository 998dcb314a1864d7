"""A run that ends before its last step: stopped early (a signal, a CANCEL file, the time limit, a write error), or
failed at a collective because of another rank. A module of its own so that `import train` does not load it: train.py
imports it only then.
"""

import os

import torch.distributed as dist

from metrics import SinkError


def end_early(run, reason):
    """After the checkpoint of an early stop: wait for it to land, then say why the run stopped."""
    run.checkpointer.wait()
    if reason == "write error":
        failed = run.writer.sinks.failed if run.writer.sinks else "rank 0 could not write its metrics"
        raise SinkError(f"{failed}; a checkpoint was saved at step {run.state.step}: free disk space, "
                        f"then run the same command again to resume.")
    saved = not run.cfg.train.no_checkpoints  # (a benchmark saves none)
    run.notifier.outcome = (f"{run.stopper.describe(reason)} after step {run.state.step}; "
                            + ("its checkpoint is saved" if saved else "no checkpoint (train.no_checkpoints)"))
    if run.is_master:
        if reason == "cancel file":  # it has done its job: left there, it would cancel the resumed run at once
            os.remove(os.path.join(run.cfg.train.out_dir, "CANCEL"))
        print(f"{run.stopper.describe(reason)} after step {run.state.step}; " + (
            "the checkpoint is saved: run the same command again to resume." if saved else
            "train.no_checkpoints saved no checkpoint, so running the command again starts from step 0."),
            flush=True)


def collective_failure(error):
    """One sentence for a collective that failed because of another rank, else None."""
    text = str(error).lower()
    if not (dist.is_initialized() and isinstance(error, RuntimeError)):
        return None
    if "timed out" in text or "timeout" in text:
        return (f"rank {dist.get_rank()} waited train.dist_timeout seconds at a collective for a rank that never came "
                f"({str(error).splitlines()[0][-120:]}); another rank is hung or died: see its output, run `python "
                f"debug.py stacks OUT_DIR` while a job hangs, or raise train.dist_timeout if the wait is expected.")
    if "closed by peer" in text or "connection reset" in text:
        return (f"rank {dist.get_rank()} lost its connection to another rank, which ended first; that rank's output "
                f"says why (the first error in the log).")
    return None
