import itertools
import subprocess
import sys

import torch
from torch.nn import functional as F

import warm_python
from conftest import ROOT, TINY, run_train
from model import GPT, GPTConfig
from sample import beam_search, generate


def small_vocab_model(vocab=4, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=vocab)).eval()


def sequence_log_prob(model, prompt, continuation):
    tokens = torch.tensor([prompt + continuation])
    logits = model(tokens[:, :-1])
    log_probs = F.log_softmax(logits[0, len(prompt) - 1:], dim=-1)
    return sum(log_probs[i, t].item() for i, t in enumerate(continuation))


def test_beam_size_one_is_greedy_decoding():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))
    torch.manual_seed(1)
    model.eval()
    prompt = [464, 3290, 318]
    greedy = generate(model, torch.tensor([prompt]), 8, temperature=0)[0].tolist()
    [(beam, _)] = beam_search(model, prompt, beam_size=1, max_new_tokens=8)
    assert beam == greedy


def test_beam_search_finds_the_best_sequence_found_by_exhaustive_search():
    for seed in range(3):
        model = small_vocab_model(seed=seed)
        prompt, length = [0], 3
        with torch.no_grad():
            scored = sorted(((sequence_log_prob(model, prompt, list(c)), list(c))
                             for c in itertools.product(range(4), repeat=length)), reverse=True)
            # 16 beams hold every prefix of length 2, so the search is exact here.
            beams = beam_search(model, prompt, beam_size=16, max_new_tokens=length)
        assert beams[0][0] == prompt + scored[0][1]
        assert abs(beams[0][1] - scored[0][0]) < 1e-4
        assert [b[0][1:] for b in beams[:4]] == [s[1] for s in scored[:4]]


def test_beam_search_stops_beams_at_the_stop_token():
    model = small_vocab_model(seed=0)
    with torch.no_grad():
        beams = beam_search(model, [0], beam_size=4, max_new_tokens=6, stop_token=2)
    for tokens, _ in beams:
        assert 2 not in tokens[1:-1]  # a stop token can only be last
    assert [s for _, s in beams] == sorted([s for _, s in beams], reverse=True)


def test_sample_cli_prints_prompt_and_continuation_and_beams(data_root, tmp_path):
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}", "--train.max_steps=2"])
    common = [sys.executable, "sample.py", f"--init_from={tmp_path / 'run'}", "--prompt=ROMEO:", "--device=cpu",
              "--max_new_tokens=5"]
    sampled = subprocess.run(common + ["--num_samples=2", "--top_p=0.9", "--seed=3"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    assert sampled.count("--- sample") == 2 and sampled.count("ROMEO:") == 2
    again = subprocess.run(common + ["--num_samples=2", "--top_p=0.9", "--seed=3"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout
    assert sampled == again  # the seed makes samples repeatable
    beams = subprocess.run(common + ["--beam_size=3"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert beams.count("--- beam") == 3 and "log-probability" in beams


def test_unknown_init_from_fails_with_one_sentence(tmp_path):
    result = warm_python.python(["sample.py", f"--init_from={tmp_path / 'nothing'}"], ROOT)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "is not a folder nor one of gpt2" in result.stderr


def rope_fork_at_gpt2_scale(seed=0):
    """A RoPE fork that reads its offset from kv_cache.length (tests/test_forks.py), at GPT-2's initial scale."""
    from test_forks import ROPE_AT_GPT2_SCALE

    namespace = {}
    exec(ROPE_AT_GPT2_SCALE, namespace)
    torch.manual_seed(seed)
    return namespace["GPT"](GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))


def test_the_kv_cache_is_checked_at_float_noise():
    """The unforked model's cache is within float noise of model(idx); a RoPE fork at GPT-2's initial scale,
    3e-5 of the scale off, is refused with what to change."""
    from sample import kv_cache_problem

    torch.manual_seed(0)
    assert kv_cache_problem(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32))) == ""
    problem = kv_cache_problem(rope_fork_at_gpt2_scale())
    assert "other log-probabilities than its plain forward model(idx)" in problem
    assert problem.endswith("(a position read from kv_cache.length inside a layer is a usual cause).")
