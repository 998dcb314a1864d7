"""What the answer's process runs for exercise 16 (checks_capstone.py grades it): the answer's attention,
its GPT on the check's seed and tokens (with a cache, on packed rows, with dropout), and train.py training it;
all of it with torch's own attention refused, noting which of the student's exercise-10 parts the GPT calls
and which of its classes derive from model.py's. feeding.py says what a feed module is, and holds."""

import contextlib
import sys
import tempfile
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from exercises.grader.feeding import TINY_RUN, ExerciseFailed, run_training

# What exercise 10 asks, which the capstone's GPT is to be assembled from (exercises/16_gpt.py's `parts`).
PARTS = ("mlp", "block_forward", "embed", "tie_weights", "init_weights", "next_token_loss")
TORCHS_ATTENTION = ("exercise 16 asks you to write attention out, yet your answer called torch's "
                    "scaled_dot_product_attention: compute the scores, mask them, softmax them and mix the values "
                    "in your own attention, and call it from your CausalSelfAttention.")


class TorchsAttentionRefused(TorchFunctionMode):
    """F.scaled_dot_product_attention, refused where it is called (it may decompose into plain matmuls below)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "scaled_dot_product_attention":
            raise ExerciseFailed(TORCHS_ATTENTION)
        return func(*args, **(kwargs or {}))


class TorchsAttentionKernelsRefused(TorchDispatchMode):
    """The kernels behind it (aten._scaled_dot_product_*), refused however they are reached (torch.ops.aten)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            raise ExerciseFailed(TORCHS_ATTENTION)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def written_by_the_student(answers):
    """Inside the block torch's attention is refused; yields the set of exercise 10's parts (`PARTS`, the
    functions of the 10_*.py beside the answer file) that were called in it."""
    folder = Path(answers.__file__).resolve().parent
    tens = {str(path.resolve()) for path in folder.glob("10_*.py")}
    called, previous = set(), sys.getprofile()

    def note(frame, event, arg):
        if event == "call" and frame.f_code.co_name in PARTS and frame.f_code.co_filename in tens:
            called.add(frame.f_code.co_name)

    sys.setprofile(note)
    try:
        with TorchsAttentionRefused(), TorchsAttentionKernelsRefused():
            yield called
    finally:
        sys.setprofile(previous)


def from_model_py(gpt):
    """"CLASS derives from model.py's BASE" for the first of `gpt`'s modules whose class is or inherits one of
    model.py's classes, else None: the capstone is the student's to write, not model.py's to extend."""
    for module in gpt.modules():
        base = next((c for c in type(module).__mro__ if c.__module__ == "model"), None)
        if base is not None:
            return f"{type(module).__name__} derives from model.py's {base.__name__}"
    return None


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
    with written_by_the_student(answers) as called:
        results = assembled(answers, inputs)
    results["parts"] = sorted(called)
    return results


def assembled(answers, inputs):
    from model import GPTConfig
    from sample import KVCache

    results = {"attention": [with_gradients(answers.attention, case) for case in inputs["attention"]]}
    config = GPTConfig(**inputs["config"])
    torch.manual_seed(inputs["seed"])
    gpt = answers.GPT(config).eval()
    results["borrowed"] = from_model_py(gpt)
    results["weights"] = dict(gpt.named_parameters())
    # every name of every parameter, a tied weight under both: which one named_parameters keeps hangs on order
    results["names"] = [name for name, _ in gpt.named_parameters(remove_duplicate=False)]
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
    with tempfile.TemporaryDirectory() as out, TorchsAttentionRefused(), TorchsAttentionKernelsRefused():
        rows = run_training(training_args(*inputs, out) + [f"--train.model_module={answers.__file__}"])
    return [row["train/loss"] for row in rows]
