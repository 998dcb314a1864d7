"""The fused, chunked output layer + cross-entropy gives what F.cross_entropy on full logits gives."""

import pytest
import torch
from torch.nn import functional as F

import model
from model import GPT, GPTConfig, chunked_cross_entropy
from tokenizer import GPT2_VOCAB_SIZE


def reference_loss(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-1)


def loss_and_grads(fn, hidden, weight, targets, autocast_dtype):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = fn(hidden, weight, targets)
    (2.5 * loss).backward()  # a non-unit upstream gradient must scale both gradients
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("autocast_dtype, tolerance", [(None, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_values", [7 * 1000, 10**9])  # many slices with a ragged last one; one slice
def test_same_loss_and_gradients_as_full_logits(monkeypatch, autocast_dtype, tolerance, chunk_values):
    monkeypatch.setattr(model, "LOSS_CHUNK_VALUES", chunk_values)
    torch.manual_seed(0)
    hidden, weight = torch.randn(50, 16), torch.randn(1000, 16) * 0.5
    targets = torch.randint(0, 1000, (50,))
    targets[::3] = -1  # ignore_index=-1: not scored, no gradient
    ours = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, autocast_dtype)
    theirs = loss_and_grads(reference_loss, hidden, weight, targets, autocast_dtype)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        assert torch.allclose(a, b, rtol=tolerance, atol=tolerance * b.abs().max().item())
    assert torch.all(ours[1][::3] == 0)  # unscored rows get no gradient at all


def test_padded_vocabulary_rows_get_their_true_gradient():
    """GPT-2's 50,257 tokens padded to 50,304: the 47 extra rows are real rows of the tied embedding."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
    x = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    y = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    y[0, :5] = -1
    grads = []
    for return_logits in (False, True):
        torch.manual_seed(0)
        net = GPT(config)
        _, loss = net(x, y, return_logits=return_logits)
        loss.backward()
        grads.append({name: p.grad for name, p in net.named_parameters()})
    fused, full = grads
    padded = fused["transformer.wte.weight"][GPT2_VOCAB_SIZE:]
    assert padded.abs().sum() > 0  # softmax gives every row some probability, so some gradient
    assert torch.allclose(padded, full["transformer.wte.weight"][GPT2_VOCAB_SIZE:], rtol=1e-4, atol=1e-10)
    for name in full:
        assert torch.allclose(fused[name], full[name], rtol=1e-4, atol=1e-7), name


def test_training_forward_builds_no_logits_and_eval_paths_still_get_them():
    net = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    x = torch.randint(0, 100, (2, 8))
    logits, loss = net(x, x)
    assert logits is None and loss.ndim == 0
    logits, loss = net(x)
    assert logits.shape == (2, 8, net.config.vocab_size) and loss is None
    logits, loss = net(x, x, return_logits=True)
    assert logits.shape == (2, 8, net.config.vocab_size)
    with torch.no_grad():  # validation: the loss alone, and no gradient work
        assert torch.allclose(net(x, x)[1], loss, rtol=1e-5)


def test_torch_compile_traces_the_fused_loss_without_graph_breaks():
    """torch.compile (the default on CUDA) must see the whole forward, fused loss included, as one graph."""
    import torch._dynamo

    net = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    x = torch.randint(0, 100, (2, 8))
    explanation = torch._dynamo.explain(net)(x, x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
