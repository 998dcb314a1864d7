"""Run by test_fsdp.py under torchrun: an FSDP run whose save of step 6 never ends (a disk that hangs), for the test
to kill -9 in the middle of it. Before hanging, each rank has written half a file of its pieces, and says how many
numbers of the weights and of AdamW's state it holds against their whole count, in the file `RANK.json` of the
folder named by the environment's SAVING_NOTES (a file per rank: two ranks' prints can interleave on one line):
{"pid", "weights", "all_weights", "moments", "all_moments"}."""

import json
import os
import sys
import time

from lab import fsdp
import train

write_shards = fsdp.dcp.save


def hanging(state, checkpoint_id, **kwargs):
    if "step6" not in str(checkpoint_id):
        return write_shards(state, checkpoint_id=checkpoint_id, **kwargs)
    rank = int(os.environ["RANK"])
    weights = [t for t in state["model"].values()]
    moments = [t for per_param in state["optim"]["state"].values() for t in per_param.values() if t.dim() > 0]
    held = {"pid": os.getpid(), "weights": sum(t.to_local().numel() for t in weights),
            "all_weights": sum(t.numel() for t in weights), "moments": sum(t.to_local().numel() for t in moments),
            "all_moments": sum(t.numel() for t in moments)}
    os.makedirs(checkpoint_id, exist_ok=True)
    with open(os.path.join(checkpoint_id, f"__{rank}_0.distcp"), "wb") as f:
        f.write(b"half of a shard")
    notes = os.environ["SAVING_NOTES"]
    with open(os.path.join(notes, f"{rank}.part"), "w") as f:
        json.dump(held, f)
    os.replace(os.path.join(notes, f"{rank}.part"), os.path.join(notes, f"{rank}.json"))  # whole, or not there
    time.sleep(600)


fsdp.dcp.save = hanging
train.main(sys.argv[1:])
