"""What the answer's process runs for exercises 1 to 3 (checks_step.py grades them): the schedule the answer
reads, the tiny GPT it accumulates gradients in, the attention module it runs. feeding.py says what a feed module
is, and holds."""

import torch

from exercises.grader.feeding import gradients, tiny_gpt


def build_schedule(settings):
    from config import OptimConfig
    from optimizer import build_schedule

    return build_schedule(OptimConfig(**settings["optim"]), settings["total"])


def schedule_answers(answers, cases):
    return [[answers.lr_at(build_schedule(case), n) for n in case["steps"]] for case in cases]


def micro_batches_of(case):
    tokens, size = case["tokens"], case["size"]
    x, y = tokens[:, :-1], tokens[:, 1:]
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(case["micro_steps"])]


def accumulation_answers(answers, cases):
    results = []
    for case in cases:
        student = tiny_gpt(case["seed"])
        loss = answers.accumulate_gradients(student, micro_batches_of(case))
        results.append({"grads": gradients(student), "loss": loss,
                        "keeps_graph": bool(getattr(loss, "requires_grad", False))})
    return results


def attention_module(case):
    from model import CausalSelfAttention, GPTConfig

    attn = CausalSelfAttention(GPTConfig(n_embd=case["width"], n_head=case["heads"], block_size=case["length"]))
    attn.load_state_dict(case["weights"])
    return attn.eval()


def attention_answers(answers, cases):
    with torch.no_grad():
        return [[answers.causal_self_attention(attention_module(case), x) for x in (case["x"], case["changed"])]
                for case in cases]
