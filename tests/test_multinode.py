"""Two "nodes" on localhost: slurm/gpt2.sbatch run with stand-ins for srun and scontrol, so the very
script users submit starts two `torchrun --nnodes=2 --nproc-per-node=1 --rdzv-endpoint=127.0.0.1:PORT`
processes (gloo). Their losses must equal one process with two accumulation steps, and their
checkpoint must resume on one process."""

import os
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, read_metrics, run_train

FAKE_SRUN = """#!/bin/sh
# srun on 2 nodes: the command once per node (here twice on this machine); fails if either does.
"$@" & first=$!
"$@" & second=$!
wait $first; a=$?
wait $second; b=$?
exit $((a | b))
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_match_one_process_and_their_checkpoint_resumes_on_one(data_root, tmp_path):
    common = ["config/shakespeare.py", *TINY, f"--data.data_root={data_root}", "--train.total_batch_size=256",
              "--train.max_steps=6", "--eval.interval=0"]
    run_train(common + [f"--train.out_dir={tmp_path / 'one'}"])  # 1 process x 2 micro-steps of 4 x 32 tokens
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")  # `scontrol show hostnames`: the head node
    for tool in ("srun", "scontrol"):
        os.chmod(bin_dir / tool, 0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242",
           "NPROC_PER_NODE": "1", "PORT": str(free_port()), "CONFIG": "config/shakespeare.py",
           "OUT_DIR": str(tmp_path / "two"), "PYTHON": sys.executable}  # a venv's python, run by its path
    result = subprocess.run(["bash", "slurm/gpt2.sbatch", *common[1:], "--train.hard_stop=4steps"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 rank(s) on cpu, 1 micro-step(s) per step" in result.stdout  # two nodes of one rank each
    assert sorted(os.listdir(tmp_path / "two" / "stacks")) == ["rank0.txt", "rank1.txt"]  # global ranks; pids gone

    run_train(common + [f"--train.out_dir={tmp_path / 'two'}"])  # resume the two-node checkpoint on one process
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(one, two):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-5)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
