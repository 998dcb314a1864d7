"""Text generation: the samples the training loop writes, and a command-line sampler.

    python sample.py --init_from=out/shakespeare --prompt="ROMEO:" --max_new_tokens=200
    python sample.py --init_from=gpt2 --prompt="The meaning of life is" --beam_size=4

Sampling (temperature, top-k, top-p) runs `generate` with a KV cache (`KVCache`), so each new token
costs one token's forward pass. `--beam_size` switches to beam search, which keeps the `beam_size`
most likely continuations at every step and returns them with their log-probabilities; beam size 1
is greedy decoding.
"""

import argparse
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from checkpoint import check_source, load_model, read_trainer_state
from config import UserError, config_from_dict, run_command
from data import GPT2_VOCAB_SIZE, dataset_dir, fingerprint, get_tokenizer
from devices import pick_device


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, one pair per layer, so each new token costs O(T).
    Each layer's attention calls `append` in turn; `length` is the number of tokens cached (the
    position of the next one, as the model reads it before the first layer appends)."""
    n_layer: int
    layers: list = field(default_factory=list)  # (keys, values) of each layer
    layer: int = 0  # which layer the next `append` belongs to
    length: int = 0

    def append(self, k, v):
        if len(self.layers) < self.n_layer:  # the first tokens
            self.layers.append((k, v))
        else:
            past_k, past_v = self.layers[self.layer]
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            self.layers[self.layer] = (k, v)
        if self.layer == 0:
            self.length = k.size(2)
        self.layer = (self.layer + 1) % self.n_layer
        return k, v

    def reorder(self, index):
        """Keep the rows `index` (beam search reorders its beams after every step)."""
        self.layers = [(k[index], v[index]) for k, v in self.layers]


def filter_logits(logits, top_k=None, top_p=None, vocab_size=GPT2_VOCAB_SIZE):
    """Mask the logits a sample must never pick: the vocabulary padding (ids from `vocab_size` on,
    the tokenizer's real tokens), and (optionally) tokens outside the top k, or outside the smallest
    set whose probability reaches top_p (nucleus)."""
    logits = logits.clone()
    logits[..., vocab_size:] = float("-inf")
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = F.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = cumulative - F.softmax(sorted_logits, dim=-1) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


@torch.no_grad()
def generate(model, idx, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
             stop_token=None, generator=None, vocab_size=GPT2_VOCAB_SIZE):
    """Sample `max_new_tokens` tokens after `idx` (B, T) with a KV cache; returns (B, T + new).

    temperature scales the logits (lower is more conservative, 0 is greedy); top_k keeps only
    the k most likely tokens, top_p the smallest set of tokens whose probability reaches p
    (Holtzman et al. 2019). Generation stops early once every row has produced `stop_token`.
    A `generator` of its own keeps sampling from disturbing the training RNG (exact resume)."""
    kv_cache = KVCache(model.config.n_layer)  # (train.py holds every model to it)
    finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    new = idx
    for _ in range(max_new_tokens):
        if kv_cache.length + new.size(1) > model.config.block_size:
            # The context is full: start a fresh cache over the last block_size - 1 tokens.
            kv_cache = KVCache(model.config.n_layer)  # (train.py holds every model to it)
            new = idx[:, -(model.config.block_size - 1) :]
        logits = model(new, kv_cache=kv_cache)
        logits = filter_logits(logits[:, -1, :], top_k=top_k, top_p=top_p, vocab_size=vocab_size)
        if temperature == 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = F.softmax(logits / temperature, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)
        idx = torch.cat([idx, next_token], dim=1)
        new = next_token
        if stop_token is not None:
            finished |= next_token.squeeze(1) == stop_token
            if finished.all():
                break
    return idx


@contextmanager
def plain_numerics(device):
    """float32 as it is written, for a check that compares two paths of one model: no autocast, and
    on CUDA no TF32 matmuls (whose error would hide a small difference)."""
    device_type = torch.device(device).type
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


# How far a fast path's log-probabilities (the KV cache, packed scoring) may be from the plain
# forward's, relative to their scale (at least 1): ten times float32's noise between two orders of
# the same sums. Measured for the unforked model (2, 4 and 12 layers): up to 4e-6 apart on
# log-probabilities of scale 14, 3e-7 of it; a RoPE fork that reads its offset from kv_cache.length
# is 1e-5 to 5e-5 of it off at GPT-2's initial scale (2 layers), more as it trains.
FAST_PATH_NOISE = 4e-6


def largest_gap(fast, plain, tolerance=FAST_PATH_NOISE):
    """The largest difference of two tensors of log-probabilities, or None when it is within
    `tolerance` of their scale (a NaN is never within)."""
    gap = (fast - plain).abs().max().item()
    return None if gap <= tolerance * max(1.0, plain.abs().max().item()) else gap


@torch.no_grad()
def kv_cache_problem(model, tolerance=FAST_PATH_NOISE):
    """"" when the model's forward with a KV cache, as sampling runs it (a prompt, then a token at
    a time), gives the log-probabilities of its plain forward model(idx) on two rows of 16 random
    tokens, to float noise; else the sentence that says what to change. Made before sample.py
    prints, and by the loop before each time it samples."""
    device = next(model.parameters()).device
    length, vocab = min(16, model.config.block_size), min(model.config.vocab_size, GPT2_VOCAB_SIZE)
    idx = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(0))
    idx, prompt, was_training = idx.to(device), max(1, length // 2), model.training
    model.eval()
    with plain_numerics(device):
        plain = model(idx)
        cache = KVCache(model.config.n_layer)
        cached = [model(idx[:, :prompt], kv_cache=cache)]
        cached += [model(idx[:, t:t + 1], kv_cache=cache) for t in range(prompt, length)]
    model.train(was_training)
    gap = largest_gap(torch.cat(cached, 1)[..., :vocab].float().log_softmax(-1),
                      plain[..., :vocab].float().log_softmax(-1), tolerance)
    if gap is None:
        return ""
    return (f"the model's forward with a KV cache (a prompt, then a token at a time, as sampling "
            f"runs it) gives other log-probabilities than its plain forward model(idx), up to "
            f"{gap:.3g} apart on a few rows (float noise is under {tolerance:.0e} of their "
            f"scale), so samples would not come from the trained model; "
            "make its forward with kv_cache compute what it computes without (a position read "
            "from kv_cache.length inside a layer is a usual cause).")


def encode_prompt(prompt, tokenizer=None):
    """The prompt's tokens; an empty prompt is <|endoftext|> alone, the token GPT-2 saw before every
    document (for a character-level model, which has none, a newline)."""
    tokenizer = tokenizer or get_tokenizer()
    start = [tokenizer.eot_token] if tokenizer.eot_token is not None else tokenizer.encode("\n")
    return tokenizer.encode(prompt, allowed_special={"<|endoftext|>"}) or start


def decode_until_end(tokens, prompt, prompt_length, tokenizer=None):
    """The text of `tokens`, stopping before the first <|endoftext|> the model generated. An empty
    `prompt` became <|endoftext|> (encode_prompt), which the user did not type: then only the
    generated text."""
    tokenizer = tokenizer or get_tokenizer()
    new = tokens[prompt_length:]
    if tokenizer.eot_token in new:
        tokens = tokens[: prompt_length + new.index(tokenizer.eot_token)]
    return tokenizer.decode(tokens if prompt else tokens[prompt_length:])


@torch.no_grad()
def generate_text(model, prompt, *, num_samples, max_new_tokens, temperature, top_k, device,
                  generator=None, top_p=None, tokenizer=None):
    """`num_samples` continuations of `prompt`, as text, each ending at <|endoftext|> if the model
    wrote one. `tokenizer`: GPT-2's (None), or a character-level dataset's (data.get_tokenizer)."""
    tokenizer = tokenizer or get_tokenizer()
    tokens = encode_prompt(prompt, tokenizer)
    idx = torch.tensor([tokens] * num_samples, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    out = generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k or None,
                   top_p=top_p, stop_token=tokenizer.eot_token, generator=generator,
                   vocab_size=tokenizer.n_vocab)
    model.train(was_training)
    return [decode_until_end(row, prompt, len(tokens), tokenizer) for row in out.tolist()]


@torch.no_grad()
def beam_search(model, prompt_tokens, beam_size, max_new_tokens, stop_token=None):
    """The `beam_size` most likely continuations found, as [(tokens, log_prob), ...], best first.

    Every step extends each live beam by every token, keeps the beam_size best by total
    log-probability, and reorders the KV cache to follow them. A beam that emits `stop_token` is
    finished; the search ends when no live beam can beat the finished ones or the length is reached.
    """
    device = next(model.parameters()).device
    assert len(prompt_tokens) + max_new_tokens <= model.config.block_size, "longer than block_size"
    cache = KVCache(model.config.n_layer)
    logits = model(torch.tensor([prompt_tokens], device=device), kv_cache=cache)
    beams = torch.tensor([prompt_tokens], device=device)  # (live beams, T)
    scores = torch.zeros(1, device=device)  # total log-probability of each live beam
    finished = []
    for _ in range(max_new_tokens):
        log_probs = F.log_softmax(filter_logits(logits[:, -1, :]), dim=-1)
        candidates = (scores[:, None] + log_probs).view(-1)
        alive = int(torch.isfinite(candidates).sum())
        top_scores, top_index = candidates.topk(min(beam_size, alive))
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
            # Log-probabilities only fall as a beam grows, so a live beam below the best finished
            # one is lost.
            if len(beams) == 0 or (scores.max().item() <= best_finished
                                   and len(finished) >= beam_size):
                break
        logits = model(token[:, None], kv_cache=cache)
    finished += [(row.tolist(), s.item()) for row, s in zip(beams, scores)]
    return sorted(finished, key=lambda pair: -pair[1])[:beam_size]


def dataset_of(source, model):
    """None for a model of GPT-2's vocabulary; for a model with a smaller one (trained on a
    character-level dataset, `python prepare_data.py shakespeare-char`) the folder of that dataset,
    whose meta.json holds its characters, from the config its checkpoint saved."""
    if model.config.vocab_size >= GPT2_VOCAB_SIZE:
        return None
    path = check_source(source, "--init_from")
    cfg = config_from_dict(read_trainer_state(path)["config"]) if path else None
    data_dir = dataset_dir(cfg.data.data_root, cfg.data.dataset) if cfg else source
    if not os.path.exists(os.path.join(data_dir, "meta.json")):
        raise UserError(f"{source} has a vocabulary of {model.config.vocab_size} tokens, a "
                        "character-level model, and its dataset's characters "
                        f"({os.path.join(data_dir, 'meta.json')}) are not here; prepare that "
                        "dataset first (e.g. `python prepare_data.py shakespeare-char`).")
    get_tokenizer(data_dir)  # a damaged meta.json is one sentence of its own
    saved = None
    if path:
        saved = read_trainer_state(path).get("data_fingerprint", {}).get(cfg.data.dataset)
    if saved and saved != fingerprint(data_dir):  # the ids would decode to other characters
        raise UserError(f"the dataset under {data_dir} is not the one {path} trained on (its "
                        "meta.json or shards differ), so its ids would decode to other "
                        "characters; prepare that run's dataset again, or point data.data_root at "
                        "it.")
    return data_dir


def check_args(args):
    """Argument mistakes found before a model is loaded, each as one sentence."""
    for name, low in (("num_samples", 1), ("max_new_tokens", 1), ("top_k", 0), ("beam_size", 0)):
        if getattr(args, name) < low:
            raise UserError(f"--{name}={getattr(args, name)} is out of range; give a value of at "
                            f"least {low}.")
    # Written so that NaN fails too (it compares false with everything); infinity makes the masked
    # logits -inf / inf = NaN, which torch.multinomial rejects with a traceback.
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature={args.temperature} is out of range; give a finite value of "
                        "at least 0 (0 is greedy).")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top_p={args.top_p} is out of range; give a probability in (0, 1].")
    args.device = pick_device(args.device)


def main(argv):
    parser = argparse.ArgumentParser(description="Generate text from a trained model or GPT-2.")
    parser.add_argument("--init_from", required=True,
                        help="run folder, checkpoint, gpt2[-medium|-large|-xl] or HF folder")
    parser.add_argument("--prompt", default="\n", help="text to continue")
    parser.add_argument("--num_samples", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    parser.add_argument("--top_k", type=int, default=200, help="0 for no limit")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling; 1 for no limit")
    parser.add_argument("--beam_size", type=int, default=0,
                        help="beam search with this many beams (0: sample)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA, else Apple's MPS, else the CPU), cpu, mps or cuda:N")
    parser.add_argument("--model_module", default="model",
                        help="the .py file of the GPT a checkpoint was trained with (its path)")
    parser.add_argument("--accept_changed_code", action="store_true",
                        help="serve a checkpoint whose model code changed since with the code now")
    args = parser.parse_args(argv)
    check_args(args)
    model = load_model(args.init_from, args.device, "--init_from", args.model_module,
                       changed_ok=args.accept_changed_code)
    problem = kv_cache_problem(model)  # sampling runs the cached path: checked first
    if problem:
        raise UserError(problem)
    tokenizer = get_tokenizer(dataset_of(args.init_from, model))
    tokens = encode_prompt(args.prompt, tokenizer)
    if len(tokens) >= model.config.block_size:
        raise UserError(f"the prompt is {len(tokens)} tokens but the model reads at most "
                        f"{model.config.block_size}; give a shorter --prompt.")
    if args.beam_size:
        max_new = min(args.max_new_tokens, model.config.block_size - len(tokens))
        beams = beam_search(model, tokens, args.beam_size, max_new, tokenizer.eot_token)
        for i, (row, score) in enumerate(beams):
            print(f"--- beam {i}, log-probability {score:.3f}\n"
                  f"{decode_until_end(row, args.prompt, len(tokens), tokenizer)}")
        return
    generator = torch.Generator(args.device).manual_seed(args.seed)
    texts = generate_text(model, args.prompt, num_samples=args.num_samples,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, device=args.device, generator=generator,
                          top_p=args.top_p, tokenizer=tokenizer)
    for i, text in enumerate(texts):
        print(f"--- sample {i}\n{text}")


if __name__ == "__main__":
    run_command(main, sys.argv[1:])
