import math

import torch

from config import OptimConfig
from model import GPT, GPTConfig
from optimizer import build_optimizer
from sample import filter_logits, generate
from data import GPT2_VOCAB_SIZE


def tiny_config(**overrides):
    return GPTConfig(**{"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, **overrides})


def test_model_overfits_a_tiny_batch():
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=1024))  # (GPT-2's 50,304 rows made AdamW's step 90% of a 14 s test)
    x = torch.randint(0, 1000, (2, 16))
    y = torch.randint(0, 1000, (2, 16))
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.0, lr=3e-3))
    first = model(x, y)
    for _ in range(150):
        loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first.item() > 6.5  # ~ln(1024) at initialisation
    assert loss.item() < 0.1


def test_targets_of_minus_one_are_ignored_by_the_loss():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    x = torch.randint(0, 1000, (1, 8))
    y = torch.randint(0, 1000, (1, 8))
    full = model(x, y)
    masked = y.clone()
    masked[0, 4:] = -1
    partial = model(x, masked)
    logits = model(x)
    expected = torch.nn.functional.cross_entropy(logits[0, :4], y[0, :4])
    assert torch.allclose(partial, expected) and not torch.allclose(partial, full)


def test_weights_are_tied_and_residual_projections_scaled():
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=8, n_embd=256, n_head=4))
    assert model.lm_head.weight is model.transformer.wte.weight
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert math.isclose(std, 0.02 / math.sqrt(16), rel_tol=0.1)
    assert math.isclose(model.transformer.h[0].mlp.c_fc.weight.std().item(), 0.02, rel_tol=0.1)


def test_gpt2_124m_parameter_counts():
    model = GPT(GPTConfig())  # GPT-2 small with the padded vocabulary
    assert model.num_params() == 124_475_904
    assert model.num_params(non_embedding=True) == 124_475_904 - 50304 * 768 - 1024 * 768


def test_flops_per_token_is_6n_plus_attention():
    model = GPT(tiny_config())
    c = model.config
    n = model.num_params(non_embedding=True) + c.n_embd * c.vocab_size
    assert model.flops_per_token() == 6 * n + 12 * c.n_layer * c.n_embd * c.block_size
    from metrics import StepClock

    clock = StepClock(lambda: None, 1000, c.block_size, model.flops_per_token(), world_size=1, peak_flops=1e12)
    clock.last_end -= 1.0  # a step of about one second
    speed, _ = clock.lap(tokens_seen=1000, data_time=0.0)
    tokens_per_sec = speed["throughput/tokens_per_sec"]
    assert math.isclose(speed["throughput/mfu"], model.flops_per_token() * tokens_per_sec / 1e12)


def test_weight_decay_only_on_matrices():
    model = GPT(tiny_config())
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1, lr=1e-3))
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decayed["params"])
    assert plain["weight_decay"] == 0.0 and all(p.dim() < 2 for p in plain["params"])
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == model.num_params()


def test_padded_vocabulary_never_wins_a_sample():
    logits = torch.zeros(3, 50304)
    logits[:, GPT2_VOCAB_SIZE:] = 100.0  # the padding rows are the most likely by far
    filtered = filter_logits(logits, top_k=5)
    assert torch.isinf(filtered[:, GPT2_VOCAB_SIZE:]).all()
    assert (filtered.argmax(-1) < GPT2_VOCAB_SIZE).all()


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = torch.full((1, 50304), -10.0)
    logits[0, :4] = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert torch.isfinite(filter_logits(logits, top_k=2)).sum() == 2
    probs = torch.softmax(logits[0, :GPT2_VOCAB_SIZE], -1)
    kept = torch.isfinite(filter_logits(logits, top_p=0.9))[0]
    # The smallest prefix of the sorted tokens whose probability reaches 0.9.
    need = int((probs.sort(descending=True).values.cumsum(0) < 0.9).sum()) + 1
    assert kept.sum() == need and kept[:need].all()


def test_kv_cache_generation_equals_recomputing_the_whole_prefix():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    idx = torch.randint(0, 1000, (2, 3))
    cached = generate(model, idx, 10, temperature=0)
    slow = idx
    for _ in range(10):
        logits = model(slow)
        slow = torch.cat([slow, filter_logits(logits[:, -1]).argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, slow)


def test_peak_flops_lookup_for_mfu(monkeypatch):
    from devices import DEVICES

    # unknown: MFU is not logged
    assert DEVICES["cpu"].peak_flops("cpu") is None and DEVICES["mps"].peak_flops("mps") is None
    for name, expected in [("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 80GB HBM3", 989e12),
                           ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA H200", 989e12), ("Tesla T4", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert DEVICES["cuda"].peak_flops("cuda") == expected, name


def test_the_output_layer_is_found_whatever_its_requires_grad_and_the_grad_mode():
    """output_parameters reads autograd's graph of one row: a frozen token embedding (the tied output layer) was no
    leaf of it, so FLOPs and MFU counted 55x too few; and it is read afresh, so a model untied after a first call
    is answered as it is now."""
    from model import output_parameters

    model = GPT(tiny_config())
    expected = model.num_params_with_output()
    model.transformer.wte.weight.requires_grad_(False)
    with torch.inference_mode():
        assert model.num_params_with_output() == expected
    assert not model.transformer.wte.weight.requires_grad  # as it was
    model.lm_head = torch.nn.Linear(32, model.config.vocab_size, bias=False)  # untied after that
    assert output_parameters(model) == [model.lm_head.weight]
    assert model.param_groups()["output"] == [model.lm_head.weight]
