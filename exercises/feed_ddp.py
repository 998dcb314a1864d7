"""What each rank runs for exercises 15 and 20 (checks_ddp.py grades them), under torchrun on gloo: a tiny
GPT's backward on the rank's part of the batch and the answer's averaging; a DDP model and the answer's
accumulation with no_sync. feeding.py says what a feed module is, and holds."""

import torch

from exercises.feeding import gradients, tiny_gpt

HALF = 4  # sequences per rank


def batch(seed, sequences):
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 512, (sequences, 17), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def gathered(value):
    """Every rank's `value`, in rank order (on every rank)."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def averaging_answers(answers, seed):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = tiny_gpt(seed)
    x, y = batch(seed, HALF * dist.get_world_size())
    mine = slice(rank * HALF, (rank + 1) * HALF)
    model(x[mine], y[mine]).backward()  # each rank its half of the batch
    answers.average_gradients(model, dist.get_world_size())
    return gathered(gradients(model))


def no_sync_batches(seed, micro_steps, rank, step):
    """Rank `rank`'s micro-batches of optimizer step `step`, cut from the step's whole batch."""
    x, y = batch(seed + 1000 * step, 2 * micro_steps * 2)
    first = rank * micro_steps * 2
    return [(x[first + 2 * i:first + 2 * i + 2], y[first + 2 * i:first + 2 * i + 2]) for i in range(micro_steps)]


def no_sync_answers(answers, inputs):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, micro_steps = dist.get_rank(), inputs["micro_steps"]
    # Small buckets, so that several all-reduces make up one step once DDP has rebuilt them (after step 1).
    model = DDP(tiny_gpt(inputs["seed"]), bucket_cap_mb=0.05)
    forwards, reduced = [0], []

    def count_all_reduces(state, bucket):  # DDP's own all-reduce (the mean over ranks), noted per micro-step
        reduced.append(forwards[0])
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(None, count_all_reduces)
    model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    steps = []
    for step in (1, 2):
        forwards[0], reduced[:] = 0, []
        loss = answers.accumulate_with_ddp(model, no_sync_batches(inputs["seed"], micro_steps, rank, step))
        steps.append({"grads": gradients(model.module), "all_reduces": list(reduced), "loss": loss,
                      "keeps_graph": bool(getattr(loss, "requires_grad", False))})
        model.zero_grad(set_to_none=True)
    return gathered(steps)
