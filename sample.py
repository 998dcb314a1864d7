"""Text generation: the samples the training loop writes, and (later) a command-line sampler.

`generate_text` turns a prompt into `num_samples` continuations with the model's KV-cache sampler.
"""

import torch

from tokenizer import EOT_TOKEN, get_tokenizer


@torch.no_grad()
def generate_text(model, prompt, num_samples, max_new_tokens, temperature, top_k, device, generator=None):
    enc = get_tokenizer()
    tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT_TOKEN]
    idx = torch.tensor([tokens] * num_samples, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k or None, generator=generator)
    model.train(was_training)
    return [enc.decode(row[: row.index(EOT_TOKEN, len(tokens))] if EOT_TOKEN in row[len(tokens):] else row)
            for row in out.tolist()]
