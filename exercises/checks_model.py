"""The check of exercise 10, the capstone: the student's GPT, part by part, then trained by train.py.

Each part is compared with model.py's on random inputs; then the real trainer trains the student's GPT
(`train.model_module`) and model.py's on the same seed and data, and the two loss curves must match.
"""

import random
import tempfile
from pathlib import Path

import torch
from torch.nn import functional as F

from exercises.checking import ExerciseFailed, TINY_RUN, is_close, patched, run_training, shown

CAPSTONE = Path(__file__).resolve().parent / "10_gpt.py"


def random_config(rng):
    from model import GPTConfig

    heads = rng.choice([1, 2, 4])
    return GPTConfig(n_layer=rng.randint(1, 4), n_head=heads, n_embd=heads * rng.choice([8, 16]),
                     block_size=rng.choice([8, 16]), vocab_size=rng.choice([64, 100]), bias=rng.random() < 0.7)


def same(mine, want, tolerance=1e-6):
    return torch.is_tensor(mine) and mine.shape == want.shape and torch.allclose(mine, want, rtol=tolerance,
                                                                                  atol=tolerance)


def check_parts(answers, rng):
    """mlp, block_forward, embed, tie_weights, init_weights and next_token_loss against model.py."""
    from model import GPT, Block

    config = random_config(rng)
    torch.manual_seed(rng.randint(0, 10**6))
    block = Block(config).eval()
    x = torch.randn(2, config.block_size, config.n_embd)
    with torch.no_grad():
        if not same(answers.mlp(block.mlp, x), block.mlp(x)):
            raise ExerciseFailed("mlp differs from model.py's MLP: c_fc widens to 4 x n_embd, then GELU (module.gelu, "
                                 "GPT-2's tanh approximation), then c_proj back to n_embd.")
        mine, want = answers.block_forward(block, x), block(x)
        if not same(mine, want):
            without = block.mlp(block.ln_2(block.attn(block.ln_1(x))))
            advice = ("add each sub-layer's output back to its input (the residual stream: x + attn(ln_1(x)), "
                      "then + mlp(ln_2(...)))" if same(mine, without) else
                      "each sub-layer reads a LayerNorm of the stream (pre-LayerNorm: ln_1 before attention, ln_2 "
                      "before the MLP) and adds its output back")
            raise ExerciseFailed(f"block_forward differs from model.py's Block: {advice}.")
    gpt = GPT(config)
    idx = torch.randint(0, config.vocab_size, (2, config.block_size))
    want = gpt.transformer.wte(idx) + gpt.transformer.wpe(torch.arange(config.block_size))
    if not same(answers.embed(gpt, idx), want):
        raise ExerciseFailed("embed differs from model.py's: add each token's embedding (wte) and its position's "
                             "(wpe, positions 0 to T-1).")
    gpt.lm_head.weight = torch.nn.Parameter(gpt.lm_head.weight.detach().clone())  # untied
    answers.tie_weights(gpt)
    if gpt.lm_head.weight is not gpt.transformer.wte.weight:
        raise ExerciseFailed("after tie_weights the output layer and the token embedding are two tensors: make "
                             "them one Parameter (assign one module's weight to the other).")
    seed = rng.randint(0, 10**6)
    torch.manual_seed(seed)
    reference = GPT(config)
    torch.manual_seed(seed)
    mine = answers.GPT(config)
    for (name, a), (_, b) in zip(mine.named_parameters(), reference.named_parameters()):
        if not torch.equal(a, b):
            a_std, b_std = shown(a.std().item(), b.std().item())
            raise ExerciseFailed(f"after init_weights, {name} has std {a_std} where GPT-2's initialisation gives "
                                 f"{b_std}: weights normal(0, 0.02), biases zero, and the layers that add into the "
                                 f"residual stream (residual_projection) scaled by 1/sqrt(2 x n_layer).")
    logits = torch.randn(3, 7, config.vocab_size) * 3
    targets = torch.randint(0, config.vocab_size, (3, 7))
    targets[0, :2] = -1
    want = F.cross_entropy(logits.view(-1, config.vocab_size), targets.view(-1), ignore_index=-1)
    got = answers.next_token_loss(logits, targets)
    if not (torch.is_tensor(got) and is_close(got.item(), want.item(), rel=1e-5)):
        shifted = F.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), targets[:, 1:].reshape(-1),
                                  ignore_index=-1)
        advice = ("the targets are already the next tokens: do not shift them again" if torch.is_tensor(got)
                  and is_close(got.item(), shifted.item(), rel=1e-5) else
                  "minus the mean log-softmax of each target, over the targets that are not -1")
        got, want = shown(got, want)
        raise ExerciseFailed(f"next_token_loss is {got} where F.cross_entropy gives {want}: {advice}.")


QUICK_START = Path(__file__).resolve().parent.parent / "config" / "shakespeare.py"


def check_gpt(answers, data_root="", steps=20, quick_start=True):
    """The capstone: every part, then your GPT trained by train.py against model.py's, at the quick start's
    shape (config/shakespeare.py: 4 layers x 128 wide) or, with quick_start=False, a tiny one (tests)."""
    import train

    check_parts(answers, random.Random())
    shape = [str(QUICK_START), "--optim.warmup_steps=2", "--eval.sample_interval=0"] if quick_start else TINY_RUN
    common = shape + [f"--data.data_root={data_root}", f"--train.max_steps={steps}", "--eval.interval=0",
                      "--train.no_checkpoints=true", "--train.loss_path=full"]
    original = train.gpt_class
    with tempfile.TemporaryDirectory() as out, \
            patched(train, "gpt_class", lambda module: answers.GPT if module != "model" else original(module)):
        want = run_training(common + [f"--train.out_dir={out}/model"])
        mine = run_training(common + [f"--train.out_dir={out}/yours", f"--train.model_module={CAPSTONE}"])
    for a, b in zip(mine, want):
        tolerance = 1e-5 if b["step"] == 1 else 1e-3
        if not is_close(a["train/loss"], b["train/loss"], rel=tolerance):
            got, expected = shown(a["train/loss"], b["train/loss"])
            raise ExerciseFailed(f"trained by train.py, your GPT's loss at step {b['step']} is {got} where model.py's "
                                 f"is {expected} on the same seed and data: every part matched alone, so look at how "
                                 f"GPT assembles them (the order of modules decides the initial weights).")
    where = "the quick start's shape" if quick_start else "a tiny shape"
    return (f"every part matches model.py, and train.py trained your GPT at {where} for {steps} steps with model.py's "
            f"loss curve: {want[0]['train/loss']:.4f} at step 1, {want[-1]['train/loss']:.4f} at step {steps} "
            f"(yours: {mine[-1]['train/loss']:.4f}).")
