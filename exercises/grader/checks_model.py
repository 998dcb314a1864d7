"""The check of exercise 10: GPT-2's parts, each against model.py in value and in gradient.

On a random shape, each part runs in the answer's process on the weights and inputs made here, and backward
runs through it with a random upstream gradient; the values and every gradient (of the input and of each
weight) come back and are compared with model.py's modules, run here. The initialisation is compared by
its distribution (a sample std, against the formula model.py's weights follow).
"""

import math
import random

import torch
from torch.nn import functional as F

from exercises.grader.checking import ExerciseFailed, compared, gradient_advice, is_close, same_tensor, shown
from exercises.grader.feed_model import built, parts_answers, run_part


def random_config(rng):
    heads = rng.choice([1, 2, 4])
    return dict(n_layer=rng.randint(1, 4), n_head=heads, n_embd=heads * rng.choice([8, 16]),
                block_size=rng.choice([8, 16]), vocab_size=rng.choice([64, 100]), bias=rng.random() < 0.7)


VALUE_ADVICE = {
    "mlp": "mlp differs from model.py's MLP: c_fc widens to 4 x n_embd, then GELU (module.gelu, GPT-2's tanh "
           "approximation), then c_proj back to n_embd",
    "block_forward": "block_forward differs from model.py's Block: each sub-layer reads a LayerNorm of the stream "
                     "(pre-LayerNorm: ln_1 before attention, ln_2 before the MLP) and adds its output back",
    "embed": "embed differs from model.py's: add each token's embedding (wte) and its position's (wpe, positions "
             "start to start + T - 1)",
}


def compare_part(part, mine, want, advice):
    """Raise ExerciseFailed when the value of a part differs from model.py's, then when a gradient does."""
    if not same_tensor(mine["value"], want["value"]):
        raise ExerciseFailed(f"{advice}.")
    for name, grad in want["grads"].items():
        what = "its input x" if name == "input 0" else "the logits" if part == "next_token_loss" else name
        wrong = gradient_advice(what, mine["grads"].get(name), grad)
        if wrong:
            raise ExerciseFailed(f"{part}: {wrong}.")


def init_formula(name, reference, n_layer):
    """(the std model.py's initialisation gives this weight, as a formula, its value) or None for a weight that
    starts at a constant (a bias at 0, a LayerNorm gain at 1): told apart by model.py's own fresh weights."""
    if reference.std() == 0:
        return None
    residual = 0.02 / math.sqrt(2 * n_layer)
    if abs(reference.std().item() - residual) < abs(reference.std().item() - 0.02):
        return f"0.02 / sqrt(2 x {n_layer})", residual
    return "0.02", 0.02


def compare_init(mine, n_layer, seed):
    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    reference = GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=64, block_size=32, vocab_size=128))
    for name, want in reference.named_parameters():
        got = mine.get(name)
        if not torch.is_tensor(got) or got.shape != want.shape:
            raise ExerciseFailed(f"after init_weights the GPT has no {name} of shape {tuple(want.shape)}: initialise "
                                 f"the weights in place (torch.nn.init), do not replace them.")
        formula = init_formula(name, want, n_layer)
        if formula is None:
            if not torch.equal(got, want):
                what = "a bias starts at 0" if name.endswith("bias") else "a LayerNorm gain starts at 1"
                raise ExerciseFailed(f"after init_weights, {name} is not what GPT-2 starts it at: {what} (and "
                                     f"init_weights leaves LayerNorm as it is built).")
            continue
        text, std = formula
        sample = got.float().std().item()
        if abs(sample / std - 1) > 0.1 or abs(got.float().mean().item()) > 5 * std / math.sqrt(got.numel()):
            reason = ("the layers that add into the residual stream (residual_projection) are scaled by "
                      "1/sqrt(2 x n_layer)" if "sqrt" in text else "weights of Linear and Embedding layers are "
                      "normal(0, 0.02)")
            raise ExerciseFailed(f"after init_weights, {name} has a sample std of {sample:.3g} where GPT-2's "
                                 f"initialisation draws it from normal(0, {text}): {reason}.")


def check_gpt_parts(answers):
    from model import GPT, Block, GPTConfig

    rng = random.Random(random.getrandbits(64))
    shape = random_config(rng)
    config = GPTConfig(**shape)
    torch.manual_seed(rng.randint(0, 10**6))
    block, gpt = Block(config).eval(), GPT(config).eval()
    T = rng.randint(2, config.block_size)
    start = rng.randint(0, config.block_size - T)
    logits = torch.randn(3, 7, config.vocab_size) * 3
    targets = torch.randint(0, config.vocab_size, (3, 7))
    targets[0, :2] = -1
    inputs = {"config": shape, "block": block.state_dict(), "gpt": gpt.state_dict(),
              "x": torch.randn(2, T, config.n_embd), "upstream": torch.randn(2, T, config.n_embd),
              "idx": torch.randint(0, config.vocab_size, (2, T)), "start": start, "logits": logits, "targets": targets,
              "init_config": dict(n_layer=rng.randint(2, 4), n_head=2, n_embd=64, block_size=32, vocab_size=128),
              "init_seed": rng.randint(0, 10**6)}
    mine = answers.run(parts_answers, inputs)
    block, gpt = built(inputs)
    x, upstream = inputs["x"], inputs["upstream"]
    compare_part("mlp", mine["mlp"], run_part(lambda m, v: m(v), block.mlp, [x], upstream), VALUE_ADVICE["mlp"])
    value = mine["block_forward"]["value"]
    if not same_tensor(value, block(x)):
        without = block.mlp(block.ln_2(block.attn(block.ln_1(x))))
        advice = ("block_forward differs from model.py's Block: add each sub-layer's output back to its input (the "
                  "residual stream: x + attn(ln_1(x)), then + mlp(ln_2(...)))" if same_tensor(value, without)
                  else VALUE_ADVICE["block_forward"])
        raise ExerciseFailed(f"{advice}.")
    compare_part("block_forward", mine["block_forward"], run_part(lambda m, v: m(v), block, [x], upstream), "")
    reference_embed = run_part(lambda g, i, s: g.transformer.wte(i) + g.transformer.wpe(torch.arange(s, s + T)),
                               gpt, [inputs["idx"], start], upstream)
    compare_part("embed", mine["embed"], reference_embed, VALUE_ADVICE["embed"])
    if not mine["tie_weights"]["one"]:
        raise ExerciseFailed("after tie_weights the output layer and the token embedding are two tensors: make them "
                             "one Parameter (assign one module's weight to the other).")
    check_loss(mine["next_token_loss"], logits, targets)
    compare_init(mine["init_weights"], inputs["init_config"]["n_layer"], inputs["init_seed"])
    return (f"mlp, block_forward, embed, tie_weights, init_weights and next_token_loss match model.py in value and in "
            f"gradient (n_layer {config.n_layer}, n_head {config.n_head}, n_embd {config.n_embd}, bias "
            f"{config.bias}).")


def check_loss(mine, logits, targets):
    vocab = logits.size(-1)
    want = run_part(lambda lg, t: F.cross_entropy(lg.view(-1, vocab), t.view(-1), ignore_index=-1), None,
                    [logits, targets], torch.tensor(1.0))
    got = mine["value"]
    if not (torch.is_tensor(got) and got.numel() == 1 and is_close(got.item(), want["value"].item(), rel=1e-5)):
        shifted = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets[:, 1:].reshape(-1), ignore_index=-1)
        advice = ("the targets are already the next tokens: do not shift them again" if torch.is_tensor(got)
                  and got.numel() == 1 and is_close(got.item(), shifted.item(), rel=1e-5) else
                  "minus the mean log-softmax of each target, over the targets that are not -1")
        raise ExerciseFailed(f"next_token_loss is {shown(got)}, {compared(got, want['value'].item())} what "
                             f"F.cross_entropy gives: {advice}.")
    wrong = gradient_advice("the logits", mine["grads"].get("input 0"), want["grads"]["input 0"])
    if wrong:
        raise ExerciseFailed(f"next_token_loss: {wrong}.")
