"""Run by exercise 15's check under torchrun: one step of data parallelism with the student's averaging.

    torchrun --nproc-per-node=2 exercises/ddp_worker.py ANSWER_FILE OUT    rank 0 saves its weights to OUT
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from exercises.checks_core import ddp_setup  # noqa: E402

spec = importlib.util.spec_from_file_location("answers", sys.argv[1])
answers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(answers)
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
model, x, y = ddp_setup(0)
half = slice(rank * 4, rank * 4 + 4)  # each rank its half of the batch of 8
model(x[half], y[half]).backward()
answers.average_gradients(model, world_size)
with torch.no_grad():
    for p in model.parameters():
        p -= 0.1 * p.grad
weights = {name: p.detach().clone() for name, p in model.named_parameters()}
gathered = [None] * world_size
dist.all_gather_object(gathered, weights)
if rank == 0:
    agree = all(torch.equal(gathered[0][n], other[n]) for other in gathered[1:] for n in weights)
    torch.save({"weights": weights, "ranks_agree": agree}, sys.argv[2])
dist.destroy_process_group()
