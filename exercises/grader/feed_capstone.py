"""What the answer's process runs for exercise 16 (checks_capstone.py grades it): the answer's attention,
its GPT on the check's seed and tokens (with a cache, on packed rows, with dropout), and train.py training it.
feeding.py says what a feed module is, and holds."""

import tempfile
from pathlib import Path

import torch

from exercises.grader.feeding import TINY_RUN, run_training


QUICK_START = Path(__file__).resolve().parents[2] / "config" / "shakespeare.py"


def with_gradients(function, case):
    """(value, {"q": grad, "k": grad, "v": grad}) of function(q, k, v, allowed), backward from the upstream."""
    q, k, v = (case[name].clone().requires_grad_() for name in "qkv")
    value = function(q, k, v, case["allowed"])
    grads = {}
    if torch.is_tensor(value) and value.requires_grad and value.shape == case["upstream"].shape:
        (value * case["upstream"]).sum().backward()
        grads = {"q": q.grad, "k": k.grad, "v": v.grad}
    return value, grads


def assembly_answers(answers, inputs):
    from model import GPTConfig
    from sample import KVCache

    results = {"attention": [with_gradients(answers.attention, case) for case in inputs["attention"]]}
    config = GPTConfig(**inputs["config"])
    torch.manual_seed(inputs["seed"])
    gpt = answers.GPT(config).eval()
    results["weights"] = dict(gpt.named_parameters())
    results["tied"] = gpt.lm_head.weight is gpt.transformer.wte.weight
    idx, targets = inputs["idx"], inputs["targets"]
    with torch.no_grad():
        results["logits"] = gpt(idx)
        cache, split = KVCache(config.n_layer), idx.size(1) // 2
        results["cached"] = torch.cat([gpt(idx[:, :split], kv_cache=cache), gpt(idx[:, split:], kv_cache=cache)], 1)
    loss = gpt(idx, targets)
    loss.backward()
    results["loss"], results["grads"] = loss, {name: p.grad for name, p in gpt.named_parameters()}
    with torch.no_grad():
        results["packed"] = gpt.hidden_states(idx, pos=inputs["pos"], attn_mask=inputs["attn_mask"])
    results["dropout"] = trained_with_dropout(answers.GPT, inputs)
    return results


def trained_with_dropout(gpt_class, inputs):
    """The loss and gradients of a GPT of `gpt_class` in training mode at dropout 0.1, on the inputs' seed."""
    from model import GPTConfig

    torch.manual_seed(inputs["seed"])
    gpt = gpt_class(GPTConfig(**inputs["config"], dropout=0.1)).train()
    torch.manual_seed(inputs["seed"] + 1)
    loss = gpt(inputs["idx"], inputs["targets"])
    loss.backward()
    return {"loss": loss, "grads": {name: p.grad for name, p in gpt.named_parameters()}}


def training_args(data_root, steps, quick_start, out):
    # The quick start's model, on 2 sequences a step where it trains on 8: the same computation, a quarter of the time
    # (most of it the output layer's 50,304 logits of each token).
    shape = [str(QUICK_START), "--data.batch_size=2", "--train.total_batch_size=256", "--optim.warmup_steps=2",
             "--eval.sample_interval=0"] if quick_start else TINY_RUN
    return shape + [f"--data.data_root={data_root}", f"--train.max_steps={steps}", "--eval.interval=0",
                    "--train.no_checkpoints=true", "--train.loss_path=full", f"--train.out_dir={out}"]


def training_answers(answers, inputs):
    with tempfile.TemporaryDirectory() as out:
        rows = run_training(training_args(*inputs, out) + [f"--train.model_module={answers.__file__}"])
    return [row["train/loss"] for row in rows]
