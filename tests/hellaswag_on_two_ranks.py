"""Run by test_tasks.py under torchrun: score examples split over 2 gloo ranks.

    hellaswag_on_two_ranks.py OUT.json      copa, mmlu and winogrande, 7 examples each
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hellaswag_eval  # noqa: E402
from hellaswag_fixture import tiny_model  # noqa: E402

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
task_examples = hellaswag_eval.load_tasks(["copa", "mmlu", "winogrande"], 64, limit=7)
result = hellaswag_eval.evaluate_tasks(tiny_model(), task_examples, "cpu", 2, rank, world_size)
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(result))
dist.destroy_process_group()
