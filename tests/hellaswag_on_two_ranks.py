"""Run by test_hellaswag.py under torchrun: score the examples split over 2 gloo ranks."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import hellaswag_eval  # noqa: E402
from hellaswag_fixture import tiny_model  # noqa: E402

dist.init_process_group("gloo")
examples = hellaswag_eval.load_examples(sys.argv[1])
result = hellaswag_eval.evaluate(tiny_model(), examples, "cpu", 2, dist.get_rank(), dist.get_world_size())
if dist.get_rank() == 0:
    Path(sys.argv[2]).write_text(json.dumps(result))
dist.destroy_process_group()
