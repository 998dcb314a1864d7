"""What the answer's process runs for exercise 10 (checks_model.py grades it): each of GPT-2's parts on the
weights and inputs the check made, and backward through it. feeding.py says what a feed module is, and holds."""

import torch


def run_part(function, module, inputs, upstream):
    """{"value", "grads"} of `function(module, *inputs)` with backward from `upstream`: the gradient of every
    input that is a float tensor (as "input 0", ...) and of every weight of `module`, by name."""
    inputs = [t.clone().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs]
    if module is not None:
        module.zero_grad(set_to_none=True)
    value = function(module, *inputs) if module is not None else function(*inputs)
    grads = {}
    if torch.is_tensor(value) and value.requires_grad and value.shape == upstream.shape:
        (value.float() * upstream).sum().backward()
        grads = {f"input {i}": t.grad for i, t in enumerate(inputs) if torch.is_tensor(t) and t.requires_grad}
        grads |= {name: p.grad for name, p in (module.named_parameters() if module is not None else [])}
    return {"value": value, "grads": grads}


def built(inputs):
    """model.py's Block and GPT of the case, with the weights made on the grading side."""
    from model import GPT, Block, GPTConfig

    config = GPTConfig(**inputs["config"])
    block, gpt = Block(config).eval(), GPT(config).eval()
    block.load_state_dict(inputs["block"])
    gpt.load_state_dict(inputs["gpt"])
    return block, gpt


def parts_answers(answers, inputs):
    from model import GPT, GPTConfig

    block, gpt = built(inputs)
    x, idx, start = inputs["x"], inputs["idx"], inputs["start"]
    results = {"mlp": run_part(answers.mlp, block.mlp, [x], inputs["upstream"]),
               "block_forward": run_part(answers.block_forward, block, [x], inputs["upstream"]),
               "embed": run_part(answers.embed, gpt, [idx, start], inputs["upstream"]),
               "next_token_loss": run_part(answers.next_token_loss, None, [inputs["logits"], inputs["targets"]],
                                           torch.tensor(1.0))}
    config = GPTConfig(**inputs["config"])
    untied = GPT(config)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    answers.tie_weights(untied)
    results["tie_weights"] = {"one": untied.lm_head.weight is untied.transformer.wte.weight,
                              "parameters": len(list(untied.parameters()))}
    shape = GPTConfig(**inputs["init_config"])
    torch.manual_seed(inputs["init_seed"])
    fresh = GPT(shape)
    fresh.apply(lambda module: answers.init_weights(module, shape.n_layer))
    results["init_weights"] = dict(fresh.named_parameters())
    return results
