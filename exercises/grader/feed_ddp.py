"""What each rank runs for exercises 15 and 20 (checks_ddp.py grades them), under torchrun on gloo: a tiny
GPT's backward on the rank's part of the batch and the answer's averaging; a DDP model and the answer's
accumulation with no_sync, whose all-reduces go through the grading process (all_reduce_by_the_grader). feeding.py
says what a feed module is, and holds."""

import json
import socket
import struct

import torch

from exercises.grader.feeding import gradients, tiny_gpt

HALF = 4  # sequences per rank
# exercise 20's DDP buckets: small, so that several all-reduces make up one step once DDP has rebuilt them
BUCKET_CAP_MB = 0.05


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


def send_frame(connection, header, tensor=None):
    """One message of the all-reduce counter's wire: the header's length, the header (JSON), then the tensor's
    float32 bytes. Plain bytes both ways: the grader unpickles nothing that comes from here."""
    head = json.dumps(header).encode()
    body = b"" if tensor is None else tensor.detach().to(torch.float32).contiguous().numpy().tobytes()
    connection.sendall(struct.pack("!II", len(head), len(body)) + head + body)


def receive_frame(connection):
    """(header, float32 tensor or None) of one message sent by send_frame; ConnectionError when the other end
    closed."""
    sizes = receive_exactly(connection, 8)
    head, body = struct.unpack("!II", sizes)
    header = json.loads(receive_exactly(connection, head))
    data = receive_exactly(connection, body)
    return header, (torch.frombuffer(bytearray(data), dtype=torch.float32) if body else None)


def receive_exactly(connection, size):
    data = b""
    while len(data) < size:
        more = connection.recv(size - len(data))
        if not more:
            raise ConnectionError("the other end of the all-reduce counter closed")
        data += more
    return data


def all_reduce_by_the_grader(address, rank):
    """(a connection to the grading process, DDP's communication hook that averages each bucket there). DDP calls
    the hook once per bucket when it all-reduces (never inside no_sync); the grading process, which runs no answer
    code, averages the bucket with the other rank's, sends the mean back, and keeps what it received. The hook
    sends the bucket's values alone: which parameters each bucket holds, and what they should be, the grader
    computes itself, so nothing here decides the grade (the answer can reach this hook and its socket, and
    rebind anything in its own process). `address`: a Unix socket's path (the sandbox has no network it shares
    with the grader)."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.settimeout(60)
    connection.connect(address)
    send_frame(connection, {"rank": rank})

    def hook(state, bucket):
        send_frame(connection, {}, bucket.buffer())
        _, mean = receive_frame(connection)
        future = torch.futures.Future()
        future.set_result(mean.view_as(bucket.buffer()).to(bucket.buffer().dtype))
        return future

    return connection, hook


def no_sync_answers(answers, inputs):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, micro_steps = dist.get_rank(), inputs["micro_steps"]
    model = DDP(tiny_gpt(inputs["seed"]), bucket_cap_mb=BUCKET_CAP_MB)
    connection, hook = all_reduce_by_the_grader(inputs["counter"], rank)
    model.register_comm_hook(None, hook)
    steps = []
    for step in (1, 2):
        loss = answers.accumulate_with_ddp(model, no_sync_batches(inputs["seed"], micro_steps, rank, step))
        send_frame(connection, {"step_done": step})  # the grader counts the all-reduces of each step apart
        steps.append({"grads": gradients(model.module), "loss": loss,
                      "keeps_graph": bool(getattr(loss, "requires_grad", False))})
        model.zero_grad(set_to_none=True)
    connection.close()
    return gathered(steps)
