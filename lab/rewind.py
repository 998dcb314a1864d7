"""Rewinding a run in place (`--checkpoint.resume_step=N`): OLMo's "restart from an earlier
checkpoint after a loss spike". run_dir.py's start plans it before anything changes (`plan_rewind`,
which reads only) and carries it out once the checkpoint is loaded (`rewind`); a bucket's copy is
rewound first (remote.py). Nothing is deleted: the newer checkpoints and the metrics past the step
go into `out_dir/rewound/<when>_to_step<N>/`, and rewinds.jsonl records each rewind so that a
restarted job does not rewind twice (docs/checkpoints-and-reliability.md). Loaded only then.
"""

import json
import os
import re
import shutil
import time

from checkpoint import CheckpointError
from checkpoint_folder import STEP_DIR, find_checkpoints


def plan_rewind(out_dir, step, number, bucket_steps=()):
    """checkpoint.resume_step: (step to rewind to or 0, the folder the newer checkpoints go to, a
    note). Reads only. `bucket_steps`: the complete checkpoints of checkpoint.remote_folder, which
    the rewind covers too (a step only the bucket has is downloaded to rewind to; newer ones there
    move aside in the bucket). A rewind is done once per (step, checkpoint.rewind_number), as
    rewinds.jsonl records it: the same command again (a preempted job that restarts) resumes as
    usual; a higher rewind_number rewinds to the step again. A rewind that a kill cut short left its
    `.partial` folder: it is finished there, not started anew."""
    if not step:
        return 0, "", ""
    found = set(dict(find_checkpoints(out_dir))) | set(bucket_steps)
    if step not in found:
        have = ", ".join(map(str, sorted(found))) or "none"
        where = f"{out_dir} (and its remote folder)" if bucket_steps else out_dir
        raise CheckpointError(f"checkpoint.resume_step={step} but {where} has no complete "
                              f"checkpoint at step {step} (it has: {have}); pick one of those.")
    log_path = os.path.join(out_dir, "rewinds.jsonl")
    done = []
    if os.path.exists(log_path):
        done = [json.loads(line) for line in open(log_path) if line.strip()]
    previous = [d for d in done if d["to_step"] == step and d.get("number", 1) == number]
    if previous:
        return 0, "", (f"note: already rewound to step {step} ({previous[-1]['time']}); resuming "
                       "as usual (raise checkpoint.rewind_number to rewind to it again)")
    aside = os.path.join(out_dir, "rewound")
    unfinished = sorted(name for name in (os.listdir(aside) if os.path.isdir(aside) else [])
                        if name.endswith(f"_to_step{step}.partial"))
    if not unfinished and not any(s > step for s in found):
        return 0, "", ""
    if unfinished:
        return step, os.path.join(aside, unfinished[-1]), ""
    # two rewinds in one second (or an older run's) get their own folder
    stamp, n = time.strftime('%Y%m%d-%H%M%S'), 1
    while os.path.exists(os.path.join(aside, f"{stamp}{'' if n == 1 else f'-{n}'}_to_step{step}")):
        n += 1
    return step, os.path.join(aside,
                              f"{stamp}{'' if n == 1 else f'-{n}'}_to_step{step}.partial"), ""


def rewind(out_dir, step, folder, number):
    """Carry out a planned rewind (OLMo's "restart from an earlier checkpoint after a loss spike"):
    every checkpoint after `step`, and the metrics past it, go into `folder` (`.partial` until all
    are there, then renamed), and the rewind is recorded in rewinds.jsonl. Nothing is deleted.
    Returns the line to print."""
    os.makedirs(folder, exist_ok=True)
    newer = sorted(s for s, _ in find_checkpoints(out_dir) if s > step)
    for s, path in find_checkpoints(out_dir):
        if s > step:
            os.replace(path, os.path.join(folder, f"step{s}"))
    # per-evaluation snapshots past the step go with their checkpoints
    for name in os.listdir(out_dir):
        match = re.fullmatch(r"metrics_step(\d+)\.json", name)
        if match and int(match.group(1)) > step:
            os.replace(os.path.join(out_dir, name), os.path.join(folder, name))
    metrics_path, kept = os.path.join(out_dir, "metrics.jsonl"), os.path.join(folder,
                                                                              "metrics.jsonl")
    if os.path.exists(metrics_path) and not os.path.exists(kept):
        shutil.copy2(metrics_path, kept)  # the whole log, as it was
    moved = sorted(int(n[len("step"):]) for n in os.listdir(folder) if STEP_DIR.match(n))
    final = folder[: -len(".partial")]
    os.replace(folder, final)
    link = os.path.join(out_dir, "latest")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(f"step{step}", link)
    stamp = os.path.basename(final).split("_to_step")[0]
    with open(os.path.join(out_dir, "rewinds.jsonl"), "a") as f:
        f.write(json.dumps({"time": stamp, "to_step": step, "number": number, "moved_steps": moved,
                            "folder": final}) + "\n")
    if not (newer or moved):
        return f"rewound to step {step}"
    return (f"rewound to step {step}: checkpoints {', '.join(map(str, moved)) or 'none'} and the "
            f"metrics after step {step} are in {final}")
