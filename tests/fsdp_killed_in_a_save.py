"""Run by test_fsdp.py under torchrun: an FSDP run whose save of step 6 never ends (a disk that hangs), for the test
to kill -9 in the middle of it. Before hanging, each rank has written half a file of its pieces, and says how many
numbers of the weights and of AdamW's state it holds against their whole count: `local RANK W_LOCAL W_ALL O_LOCAL
O_ALL`, then `saving step6 PID`."""

import os
import sys
import time

import sharding
import train

write_shards = sharding.dcp.save


def hanging(state, checkpoint_id, **kwargs):
    if "step6" not in str(checkpoint_id):
        return write_shards(state, checkpoint_id=checkpoint_id, **kwargs)
    rank = int(os.environ["RANK"])
    weights = [t for t in state["model"].values()]
    moments = [t for per_param in state["optim"]["state"].values() for t in per_param.values() if t.dim() > 0]
    print("local", rank, sum(t.to_local().numel() for t in weights), sum(t.numel() for t in weights),
          sum(t.to_local().numel() for t in moments), sum(t.numel() for t in moments), flush=True)
    os.makedirs(checkpoint_id, exist_ok=True)
    with open(os.path.join(checkpoint_id, f"__{rank}_0.distcp"), "wb") as f:
        f.write(b"half of a shard")
    print("saving step6", os.getpid(), flush=True)
    time.sleep(600)


sharding.dcp.save = hanging
train.main(sys.argv[1:])
