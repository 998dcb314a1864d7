"""Text generation: the samples the training loop writes, and a command-line sampler.

    python sample.py --init_from=out/shakespeare --prompt="ROMEO:" --num_samples=3 --max_new_tokens=200
    python sample.py --init_from=gpt2 --prompt="The meaning of life is" --beam_size=4

Sampling (temperature, top-k, top-p) runs `GPT.generate` with a KV cache, so each new token costs
one token's forward pass. `--beam_size` switches to beam search, which keeps the `beam_size` most
likely continuations at every step and returns them with their log-probabilities; beam size 1 is
greedy decoding.
"""

import argparse
import sys

import torch
from torch.nn import functional as F

from model import KVCache, filter_logits
from tokenizer import EOT_TOKEN, get_tokenizer


def encode_prompt(prompt):
    return get_tokenizer().encode(prompt, allowed_special={"<|endoftext|>"}) or [EOT_TOKEN]


def decode_until_end(tokens, prompt_length):
    """The text of `tokens`, stopping before the first <|endoftext|> the model generated."""
    new = tokens[prompt_length:]
    if EOT_TOKEN in new:
        tokens = tokens[: prompt_length + new.index(EOT_TOKEN)]
    return get_tokenizer().decode(tokens)


@torch.no_grad()
def generate_text(model, prompt, num_samples, max_new_tokens, temperature, top_k, device, generator=None,
                  top_p=None):
    tokens = encode_prompt(prompt)
    idx = torch.tensor([tokens] * num_samples, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k or None, top_p=top_p,
                         stop_token=EOT_TOKEN, generator=generator)
    model.train(was_training)
    return [decode_until_end(row, len(tokens)) for row in out.tolist()]


@torch.no_grad()
def beam_search(model, prompt_tokens, beam_size, max_new_tokens, stop_token=None):
    """The `beam_size` most likely continuations found, as [(tokens, log_prob), ...], best first.

    Every step extends each live beam by every token, keeps the beam_size best by total
    log-probability, and reorders the KV cache to follow them. A beam that emits `stop_token` is
    finished; the search ends when no live beam can beat the finished ones or the length is reached."""
    device = next(model.parameters()).device
    assert len(prompt_tokens) + max_new_tokens <= model.config.block_size, "prompt + new tokens > block_size"
    cache = KVCache(model.config.n_layer)
    logits, _ = model(torch.tensor([prompt_tokens], device=device), kv_cache=cache)
    beams = torch.tensor([prompt_tokens], device=device)  # (live beams, T)
    scores = torch.zeros(1, device=device)  # total log-probability of each live beam
    finished = []
    for _ in range(max_new_tokens):
        log_probs = F.log_softmax(filter_logits(logits[:, -1, :]), dim=-1)
        candidates = (scores[:, None] + log_probs).view(-1)
        top_scores, top_index = candidates.topk(min(beam_size, int(torch.isfinite(candidates).sum())))
        vocab = log_probs.size(-1)
        parent, token = top_index // vocab, top_index % vocab
        beams = torch.cat([beams[parent], token[:, None]], dim=1)
        scores = top_scores
        cache.reorder(parent)
        if stop_token is not None:
            done = token == stop_token
            finished += [(row.tolist(), s.item()) for row, s in zip(beams[done], scores[done])]
            beams, scores, token = beams[~done], scores[~done], token[~done]
            cache.reorder(torch.nonzero(~done).squeeze(1))
            best_finished = max((s for _, s in finished), default=-float("inf"))
            # Log-probabilities only fall as a beam grows, so a live beam below the best finished one is lost.
            if len(beams) == 0 or scores.max().item() <= best_finished and len(finished) >= beam_size:
                break
        logits, _ = model(token[:, None], kv_cache=cache)
    finished += [(row.tolist(), s.item()) for row, s in zip(beams, scores)]
    return sorted(finished, key=lambda pair: -pair[1])[:beam_size]


def main(argv):
    from checkpoint import CheckpointError, load_model
    from hf import WeightsError

    parser = argparse.ArgumentParser(description="Generate text from a trained model or GPT-2.")
    parser.add_argument("--init_from", required=True, help="run folder, checkpoint, gpt2[-medium|-large|-xl] or HF folder")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--num_samples", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    parser.add_argument("--top_k", type=int, default=200, help="0 for no limit")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling; 1 for no limit")
    parser.add_argument("--beam_size", type=int, default=0, help="beam search with this many beams (0: sample)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        model = load_model(args.init_from, args.device)
    except (CheckpointError, WeightsError) as error:
        sys.exit(f"error: {error}")
    tokens = encode_prompt(args.prompt)
    if args.beam_size:
        max_new = min(args.max_new_tokens, model.config.block_size - len(tokens))
        for i, (row, score) in enumerate(beam_search(model, tokens, args.beam_size, max_new, EOT_TOKEN)):
            print(f"--- beam {i}, log-probability {score:.3f}\n{decode_until_end(row, len(tokens))}")
        return
    generator = torch.Generator(args.device).manual_seed(args.seed)
    texts = generate_text(model, args.prompt, args.num_samples, args.max_new_tokens, args.temperature,
                          args.top_k, args.device, generator, top_p=args.top_p)
    for i, text in enumerate(texts):
        print(f"--- sample {i}\n{text}")


if __name__ == "__main__":
    main(sys.argv[1:])
