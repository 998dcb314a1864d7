"""The check of exercise 17: mixed precision. The truth is train.py's own step under bf16 autocast: forward hooks
record the dtype of every module's output while `train_step` runs, and its loss and gradients are those the
student's step must give (on the CPU, where torch's autocast makes the same choices for these modules as on a GPU).
"""

import random
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from exercises.grader.checking import ExerciseFailed, compared, gradient_advice, is_close, shown
from exercises.grader.checks_step import GradientKeeper, ListLoader
from exercises.grader.feed_precision import SHAPE, autocast, autocast_answers, batch, gpt

BF16 = torch.bfloat16


def shapes(rng):
    """Two GPT shapes drawn at random (depth, heads, width, vocabulary), of two depths, so that no one list of
    names fits both."""
    drawn = []
    for depth in rng.sample(range(1, 5), 2):
        heads = rng.choice([1, 2, 4])
        drawn.append(dict(n_layer=depth, n_head=heads, n_embd=heads * rng.choice([8, 16]),
                          block_size=16, vocab_size=rng.choice([128, 256, 512]), bias=rng.random() < 0.7))
    return drawn


def the_trainers_step(seed, context, shape=SHAPE):
    """train.py's train_step on one micro-batch under `context`: (dtype of each module's output, loss, grads)."""
    from train import train_step

    model, dtypes = gpt(seed, shape), {}

    def note(name):
        def hook(module, args, output):
            dtypes.setdefault(name, output.dtype)
        return hook

    for name, module in model.named_modules():
        if name and not isinstance(module, (nn.ModuleDict, nn.ModuleList)):
            module.register_forward_hook(note(name))
    keeper = GradientKeeper(model)
    metrics, _ = train_step(model, keeper, ListLoader([batch(seed, shape)]), 1, context, grad_clip=0.0)
    return dtypes, metrics["train/loss"].item(), keeper.grads


def dtype_advice(name, module_kind, says_bf16):
    if says_bf16:
        return {"LayerNorm": "autocast keeps normalisations in float32 (a mean and a variance need its precision)",
                "Embedding": "an embedding is a lookup, not a matmul: it gives the float32 weights it holds",
                "Block": "a block's output is the residual stream, its float32 input plus what attention and the MLP "
                         "add, and float32 + bfloat16 is float32 (type promotion)",
                }.get(module_kind, "an elementwise module keeps its input's dtype, float32 here")
    return {"Linear": "autocast runs matmuls (nn.Linear) in bfloat16: that is what it is for, the output layer too "
                      "(the check's GPT has loss_path=\"full\", whose forward runs lm_head as a module)",
            }.get(module_kind, "its output comes from a matmul's bfloat16 output (an elementwise module keeps its "
                               "input's dtype)")


def check_autocast(answers):
    # A loss computed in bfloat16 is a multiple of 2^-5 between 4 and 8 (the vocabularies drawn give 4.9 to 6.2):
    # tolerance (5e-5) of train.py's by chance, and a step that forgets the upcast would pass it. Such seeds are
    # drawn again, so that the bfloat16 loss is always 4 times the tolerance away.
    rng = random.Random(random.getrandbits(64))
    while True:
        seed, drawn = rng.randrange(2**31), shapes(rng)
        dtypes, want_loss, want_grads = the_trainers_step(seed, autocast(), drawn[0])
        in_bf16 = bf16_loss(seed, drawn[0])
        if not is_close(in_bf16, want_loss, rel=2e-4):
            break
    running = answers.start(autocast_answers, {"seed": seed, "shapes": drawn})
    _, _, float32_grads = the_trainers_step(seed, nullcontext(), drawn[0])
    mine = running.result()
    for shape, names, model_seed in zip(drawn, mine["names"], (seed, seed + 2)):
        compare_names(shape, names, model_seed, dtypes if model_seed == seed else None)
    cast = next((name for name, dtype in mine["weights"].items() if dtype != "torch.float32"), None)
    if cast:
        raise ExerciseFailed(f"after your step {cast} is {mine['weights'][cast]}: the weights, their gradients and the "
                             f"optimizer's state stay float32; autocast casts each matmul's inputs, never the model.")
    loss = mine["loss"]
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ExerciseFailed(f"bf16_step returned {shown(loss)[:60]}; return the loss as a one-number tensor.")
    if mine["keeps_graph"]:
        raise ExerciseFailed("the loss you return still holds its graph (requires_grad): return loss.detach().")
    mine_grads = mine["grads"]
    # before the loss: weights cast to bfloat16 for the step are the cause, a loss that differs only a consequence
    rounded = [name for name, grad in mine_grads.items() if torch.is_tensor(grad) and grad.abs().any()
               and torch.equal(grad.to(BF16).float(), grad.float())]
    if len(rounded) == len(want_grads):
        raise ExerciseFailed("every gradient of your step is a whole bfloat16 number, where train.py's are float32's: "
                             "the weights were bfloat16 during the step (a .to(torch.bfloat16) of the model, even if "
                             "cast back after); autocast casts each matmul's inputs, never the model.")
    if loss.dtype != torch.float32 or not is_close(loss.item(), want_loss, rel=5e-5):
        got = loss.float().item()
        if loss.dtype == BF16 or is_close(loss.item(), in_bf16, rel=1e-5):
            advice = (f"a loss computed in bfloat16 is a multiple of {2.0 ** (int(got).bit_length() - 8):g} "
                      f"near {got:.0f}; upcast the logits to float32 before the cross-entropy (.float()), as "
                      f"model.py does, and the loss keeps its precision")
        else:
            advice = "the loss is the mean next-token cross-entropy of the logits, ignoring targets of -1"
        raise ExerciseFailed(f"your step's loss is {shown(got)} ({str(loss.dtype).replace('torch.', '')}), "
                             f"{compared(got, want_loss)} what train.py's step under bf16 autocast gives: {advice}.")
    if all(torch.is_tensor(mine_grads.get(name)) for name in want_grads):
        error, from_float32 = (distance(mine_grads, grads) for grads in (want_grads, float32_grads))
        if error > 1e-3 and from_float32 < error:
            raise ExerciseFailed(f"your step's gradients are the float32 step's (they differ from train.py's step "
                                 f"under bf16 autocast by {error:.2%}): run the forward under torch.autocast(\"cpu\", "
                                 f"dtype=torch.bfloat16), as the trainer's step does.")
    for name, grad in want_grads.items():
        wrong = gradient_advice(name, mine_grads.get(name), grad, tolerance=1e-3, truth="train.py's step's")
        if wrong:
            raise ExerciseFailed(f"bf16_step: {wrong}.")
    return (f"the modules you name are those that give bfloat16 in train.py's step (its matmuls and what follows "
            f"them) in GPTs of {drawn[0]['n_layer']} and {drawn[1]['n_layer']} layers, {len(mine['names'][0])} in the "
            f"first, and your step's loss and gradients are its own: loss {want_loss:.5f}, which computed in bfloat16 "
            f"would be {in_bf16:.5f}.")


def compare_names(shape, names, seed, dtypes=None):
    """The names bf16_modules gave for a GPT of `shape` against the dtypes its modules give in train.py's step."""
    dtypes = dtypes or the_trainers_step(seed, autocast(), shape)[0]
    kinds = {name: type(module).__name__ for name, module in gpt(seed, shape).named_modules()}
    where = f"(a GPT of {shape['n_layer']} layers, {shape['n_head']} heads, width {shape['n_embd']})"
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ExerciseFailed(f"bf16_modules returned {shown(names)[:60]}; return a set of module names.")
    for name, dtype in dtypes.items():
        if (name in names) != (dtype == BF16):
            wrong = "bfloat16" if name in names else "float32"
            raise ExerciseFailed(f"you say {name} ({kinds[name]}) gives {wrong} under bf16 autocast {where}, and in "
                                 f"train.py's step it gives {str(dtype).replace('torch.', '')}: "
                                 f"{dtype_advice(name, kinds[name], name in names)}.")
    stranger = next((name for name in names if name not in dtypes), None)
    if stranger:
        raise ExerciseFailed(f"you name {stranger!r}, which is no module that runs in the forward of the GPT {where}.")


def distance(mine, want):
    """The norm of the difference of two sets of gradients, relative to the norm of `want`."""
    difference = torch.stack([(mine[name].float() - grad).norm() for name, grad in want.items()]).norm()
    return (difference / torch.stack([grad.norm() for grad in want.values()]).norm()).item()


def bf16_loss(seed, shape=SHAPE):
    """The loss of the same step, the cross-entropy computed in bfloat16: what the upcast avoids."""
    model = gpt(seed, shape)
    x, y = batch(seed, shape)
    with torch.no_grad(), autocast():
        logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).float().item()
