"""Run by test_trust.py under torchrun: where a resumed run starts, decided on 2 gloo ranks.

    start_on_two_ranks.py RUN_DIR OUT_PREFIX    writes OUT_PREFIX<rank>.json: the start and the checksums hashed
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import checkpoint  # noqa: E402
import run_dir  # noqa: E402
from config import config_to_dict, parse_args  # noqa: E402
from model import GPT  # noqa: E402

hashed = []
original = checkpoint.sha256_file
checkpoint.sha256_file = lambda path: hashed.append(path) or original(path)  # count every checksum taken
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
cfg = parse_args(["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
                  "--data.batch_size=4", "--train.total_batch_size=256", "--optim.name=adamw",
                  f"--train.out_dir={sys.argv[1]}"])
with torch.device("meta"):
    model = GPT(cfg.model)
start = run_dir.from_rank0(lambda: run_dir.start_on_rank0(cfg.train.out_dir, cfg.checkpoint, config_to_dict(cfg),
                                                          model), rank, world_size, None)
Path(f"{sys.argv[2]}{rank}.json").write_text(json.dumps({"path": start.path, "resumed": start.resumed,
                                                         "hashed": len(hashed)}))
dist.destroy_process_group()
