"""What the answer's process runs for exercise 17 (checks_precision.py grades it): the answer's list of
bf16 modules and its bf16 step, on model.py's GPTs of the check's shapes. feeding.py says what a feed module is,
and holds."""

import torch

BF16 = torch.bfloat16


def autocast():
    """The context train.py's start_processes builds for train.dtype=bfloat16 on this device."""
    return torch.autocast("cpu", dtype=BF16)


SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=512)


def gpt(seed, shape=SHAPE):
    """model.GPT with loss_path="full", the path whose forward runs lm_head on every position (the exercise
    says so): the trainer's default, "chunked", never calls lm_head as a module."""
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(**shape), loss_path="full")


def batch(seed, shape=SHAPE):
    tokens = torch.randint(0, shape["vocab_size"], (4, 17), generator=torch.Generator().manual_seed(seed + 1))
    return tokens[:, :-1], tokens[:, 1:]


def autocast_answers(answers, inputs):
    seed, shape, other = inputs["seed"], *inputs["shapes"]
    names = [answers.bf16_modules(gpt(seed + 2, other))]
    model = gpt(seed, shape)
    names.insert(0, answers.bf16_modules(model))
    x, y = batch(seed, shape)
    loss = answers.bf16_step(model, x, y)
    return {"names": [sorted(n) if isinstance(n, (set, list, tuple)) else n for n in names], "loss": loss,
            "keeps_graph": bool(getattr(loss, "requires_grad", False)),
            "weights": {name: str(p.dtype) for name, p in model.named_parameters()},
            "grads": {name: p.grad for name, p in model.named_parameters()}}
