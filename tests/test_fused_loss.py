"""The chunked loss gives what F.cross_entropy on the full logits gives: the fused Function where
`logits` is a plain matmul, the checkpointed slices through `logits` for any other."""

import inspect
import sys

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import model
from model import GPT, GPTConfig, LinearCrossEntropy, chunked_cross_entropy
from data import GPT2_VOCAB_SIZE


def reference_loss(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-1)


def fused_loss(hidden, weight, targets):
    return LinearCrossEntropy.apply(hidden, weight, targets, torch.is_grad_enabled())


def sliced_loss(hidden, weight, targets):
    return chunked_cross_entropy(lambda h: F.linear(h, weight), hidden, targets, weight.size(0))


def loss_and_grads(fn, hidden, weight, targets, autocast_dtype):
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = fn(hidden, weight, targets)
    (2.5 * loss).backward()  # a non-unit upstream gradient must scale both gradients
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("loss", [fused_loss, sliced_loss])
@pytest.mark.parametrize("autocast_dtype, tolerance", [(None, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_values", [7 * 1000, 10**9])  # many slices with a ragged last one; one slice
def test_same_loss_and_gradients_as_full_logits(monkeypatch, loss, autocast_dtype, tolerance, chunk_values):
    monkeypatch.setitem(model.LOSS_SLICE_VALUES, "cpu", chunk_values)
    torch.manual_seed(0)
    hidden, weight = torch.randn(50, 16), torch.randn(1000, 16) * 0.5
    targets = torch.randint(0, 1000, (50,))
    targets[::3] = -1  # ignore_index=-1: not scored, no gradient
    ours = loss_and_grads(loss, hidden, weight, targets, autocast_dtype)
    theirs = loss_and_grads(reference_loss, hidden, weight, targets, autocast_dtype)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype
        assert torch.allclose(a, b, rtol=tolerance, atol=tolerance * b.abs().max().item())
    assert torch.all(ours[1][::3] == 0)  # unscored rows get no gradient at all


def test_without_grad_the_fused_loss_does_the_forward_work_only():
    """Validation runs under torch.no_grad(): the loss alone, one matmul per slice, not the gradients'
    two more."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight = torch.randn(256, 32, requires_grad=True), torch.randn(GPT2_VOCAB_SIZE, 32, requires_grad=True)
    targets = torch.randint(0, GPT2_VOCAB_SIZE, (256,))
    forward_flops = 2 * 256 * 32 * GPT2_VOCAB_SIZE
    counted = {}
    for mode, context in (("train", torch.enable_grad()), ("eval", torch.no_grad())):
        with context, FlopCounterMode(display=False) as counter:
            loss = fused_loss(hidden, weight, targets)
            if loss.requires_grad:
                loss.backward()
        counted[mode] = (counter.get_total_flops(), loss.item())
    assert counted["eval"][0] == forward_flops and counted["train"][0] > forward_flops
    assert counted["eval"][1] == counted["train"][1]  # the same loss either way


def test_padded_vocabulary_rows_get_their_true_gradient():
    """GPT-2's 50,257 tokens padded to 50,304: the 47 extra rows are real rows of the tied embedding."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16)
    x = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    y = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    y[0, :5] = -1
    grads = []
    for path in ("chunked", "full"):
        torch.manual_seed(0)
        net = GPT(config, loss_path=path)
        loss = net(x, y)
        loss.backward()
        grads.append({name: p.grad for name, p in net.named_parameters()})
    fused, full = grads
    padded = fused["transformer.wte.weight"][GPT2_VOCAB_SIZE:]
    assert padded.abs().sum() > 0  # softmax gives every row some probability, so some gradient
    assert torch.allclose(padded, full["transformer.wte.weight"][GPT2_VOCAB_SIZE:], rtol=1e-4, atol=1e-10)
    for name in full:
        assert torch.allclose(fused[name], full[name], rtol=1e-4, atol=1e-7), name


class SoftCapped(GPT):
    """A fork that edits the logits, as Gemma 2 does: 30 * tanh(logits / 30) (Team Gemma 2024)."""

    def logits(self, h):
        return 30 * torch.tanh(super().logits(h) / 30)


class WidestRows(TorchDispatchMode):
    """The most rows of any vocabulary-wide tensor an operation makes (a view makes none)."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size, self.rows = vocab_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in [] if func.is_view else out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.size(1) == self.vocab_size:
                self.rows = max(self.rows, t.size(0))
        return out


@pytest.mark.parametrize("cls", [GPT, SoftCapped])
def test_the_chunked_loss_never_makes_all_the_logits_and_the_logits_still_come_whole(monkeypatch, cls):
    monkeypatch.setitem(model.LOSS_SLICE_VALUES, "cpu", 5 * 50304)  # 5 rows of logits at a time
    net = cls(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    x = torch.randint(0, 100, (2, 8))
    with torch.no_grad():  # an evaluation may come first: the loss alone
        first = net(x, x)
    with WidestRows(net.config.vocab_size) as widest:
        loss = net(x, x)
        loss.backward()
    assert loss.ndim == 0 and 0 < widest.rows <= 5  # slices only, never all 16 rows
    assert torch.allclose(first, loss, rtol=1e-5)
    assert net(x).shape == (2, 8, net.config.vocab_size)  # sampling still gets the logits


@pytest.mark.parametrize("logits, weight", [
    ("self.lm_head(h)", "transformer.wte.weight"),  # model.py's own, tied to the token embedding
    ("h @ self.unembed.weight.T", "unembed.weight"),  # an untied output layer by another name
    ("30 * torch.tanh(self.lm_head(h) / 30)", ""),  # a soft-cap
    ("self.lm_head(h) / 0.7", ""),  # a temperature
    ("self.unembed(h)", ""),  # a bias (the weight alone: `h @ self.unembed.weight.T`, above)
    ("self.lm_head(h * self.out_gain)", ""),  # a gain
])
def test_only_a_plain_matmul_by_one_weight_takes_the_fused_loss(logits, weight):
    class Fork(GPT):
        def __init__(self, config):
            super().__init__(config)
            self.unembed = torch.nn.Linear(config.n_embd, config.vocab_size)
            self.out_gain = torch.nn.Parameter(torch.ones(config.n_embd))

        def logits(self, h):
            return eval(logits)

    net = Fork(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8, vocab_size=100))
    assert net.output_weight is None  # not checked before the first chunked loss
    x = torch.randint(0, 100, (2, 8))
    net(x, x)
    assert net.output_weight == weight


def test_a_fork_of_logits_trains_the_same_model_on_the_chunked_and_the_full_path(monkeypatch):
    monkeypatch.setitem(model.LOSS_SLICE_VALUES, "cpu", 7 * 1000)  # several slices, a ragged last one
    x, y = torch.randint(0, 1000, (2, 16)), torch.randint(0, 1000, (2, 16))
    y[0, :3] = -1
    results = {}
    for cls in (SoftCapped, GPT):
        for path in ("chunked", "full"):
            torch.manual_seed(0)
            net = cls(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=1000), loss_path=path)
            with torch.no_grad():
                net.lm_head.weight.mul_(200)  # logits of a few tens: where the cap bites
            loss = net(x, y)
            loss.backward()
            results[cls, path] = (loss.detach(), [p.grad for p in net.parameters()])
    for cls in (SoftCapped, GPT):
        (loss, grads), (full_loss, full_grads) = results[cls, "chunked"], results[cls, "full"]
        assert torch.allclose(loss, full_loss, rtol=1e-5)
        for a, b in zip(grads, full_grads):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(results[SoftCapped, "chunked"][0], results[GPT, "chunked"][0], rtol=1e-2)  # it bites


def test_an_ordinary_step_calls_only_the_model_and_the_fused_loss():
    """After the first step has checked `logits`, a step runs the model's forwards and the Function
    (with the size of its slices) alone: no check, no inspection of autograd's graph."""
    net = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    x = torch.randint(0, 100, (2, 8))
    net(x, x).backward()
    called = set()

    def record(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == model.__file__:
            called.add(frame.f_code.co_qualname)

    sys.setprofile(record)
    try:
        net(x, x).backward()
    finally:
        sys.setprofile(None)
    assert called == {"GPT.forward", "GPT.hidden_states", "Block.forward", "CausalSelfAttention.forward",
                      "MLP.forward", "LinearCrossEntropy.forward", "loss_slice_rows", "LinearCrossEntropy.backward"}


def test_the_model_reads_no_autograd_graph_and_grafts_no_gradients():
    """The loss is plain autograd and one torch.autograd.Function: model.py names no node of autograd's
    graph and adds no term whose only purpose is its gradient."""
    source = inspect.getsource(model)
    for word in ("Backward0", "next_functions", "grad_fn", ".variable", "grad.detach()"):
        assert word not in source, word


def test_torch_compile_traces_the_fused_loss_without_graph_breaks():
    """torch.compile (the default on CUDA) must see the whole forward, fused loss included, as one graph."""
    import torch._dynamo

    net = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    x = torch.randint(0, 100, (2, 8))
    explanation = torch._dynamo.explain(net)(x, x)
    assert explanation.graph_break_count == 0, explanation.break_reasons


# ----------------------------------------------------------------------------- the loss path on GPUs


def gpt2_rows_per_micro_step(world_size):
    from config import parse_args
    cfg = parse_args(["config/gpt2.py"])
    assert cfg.train.total_batch_size % (cfg.data.batch_size * cfg.model.block_size * world_size) == 0
    return cfg.data.batch_size * cfg.model.block_size, cfg.model.vocab_size


def test_gpt2_config_is_a_handful_of_loss_slices_per_micro_step_on_cuda():
    """torchrun --nproc-per-node=8 train.py config/gpt2.py: each rank's micro-step is 64 x 1,024 rows,
    cut into 7 slices on CUDA (the laptop's 256-row slices would be 256, each too thin for a GPU)."""
    rows, vocab = gpt2_rows_per_micro_step(world_size=8)
    assert model.loss_slices(rows, vocab, "cuda") == 7
    assert model.loss_slices(rows, vocab, "cpu") == 256


class Traced(Exception):
    """Raised by the counting backend: the graph is captured, nothing is compiled or run."""


def traced_graph_nodes(net, batch_size):
    """FX nodes torch.compile captures for a forward with targets (the autograd.Function's own
    subgraphs included). The backend stops before any compiling, so only tracing costs time."""
    import torch._dynamo

    torch._dynamo.reset()
    nodes = []

    def counting_backend(graph_module, example_inputs):
        nodes.append(sum(len(m.graph.nodes) for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule)))
        raise Traced

    x = torch.zeros(batch_size, net.config.block_size, dtype=torch.long)
    with pytest.raises(Exception) as raised:
        torch.compile(net, backend=counting_backend)(x, x)
    assert "Traced" in repr(raised.value) or isinstance(raised.value, Traced)
    return sum(nodes)


def test_compiled_graph_of_a_gpt2_block_and_loss_stays_bounded_at_gpu_rows(monkeypatch):
    """The graph holds one copy of the slice loop's body per slice: at config/gpt2.py's micro-batch
    with CUDA's slices it stays a few hundred nodes (CPU-sized slices would unroll 256 times, ~8,400)."""
    # CUDA slicing, traced on CPU
    monkeypatch.setitem(model.LOSS_SLICE_VALUES, "cpu", model.LOSS_SLICE_VALUES["cuda"])
    monkeypatch.setitem(model.LOSS_SLICE_ROWS, "cpu", model.LOSS_SLICE_ROWS["cuda"])
    torch.manual_seed(0)
    net = GPT(GPTConfig(n_layer=1))  # one GPT-2 block, GPT-2's width, vocabulary and block size
    rows, vocab = gpt2_rows_per_micro_step(world_size=8)
    one_slice = traced_graph_nodes(net, 8)  # 8,192 rows: one slice
    gpt2 = traced_graph_nodes(net, rows // net.config.block_size)  # 65,536 rows: 7 slices
    per_slice = (gpt2 - one_slice) / 6
    assert gpt2 < 400 and per_slice < 50
    torch.manual_seed(0)
    net = GPT(GPTConfig(n_layer=1), loss_path="full")
    assert traced_graph_nodes(net, rows // net.config.block_size) < one_slice  # no loop at all


@pytest.mark.parametrize("device_type, compiled, expected", [
    ("cpu", "false", "chunked"), ("cpu", "true", "chunked"), ("cuda", "false", "chunked"),
    ("cuda", "true", "full"), ("mps", "true", "chunked")])
def test_auto_loss_path_is_the_one_measured_fastest(device_type, compiled, expected):
    from config import parse_args
    from plan import loss_path_on
    assert loss_path_on(parse_args([f"--train.compile={compiled}"]), device_type) == expected
    chosen = parse_args([f"--train.compile={compiled}", "--train.loss_path=chunked"])
    assert loss_path_on(chosen, device_type) == "chunked"


def test_full_and_chunked_paths_train_the_same_model():
    torch.manual_seed(0)
    x, y = torch.randint(0, 1000, (2, 16)), torch.randint(0, 1000, (2, 16))
    results = []
    for path in ("chunked", "full"):
        torch.manual_seed(0)
        net = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16), loss_path=path)
        loss = net(x, y)
        loss.backward()
        assert loss.ndim == 0  # neither path hands training the logits
        results.append((loss.detach(), [p.grad for p in net.parameters()]))
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------- the rest of the CUDA step, read by test


def test_flops_per_token_is_palms_6n_plus_attention():
    """PaLM, appendix B: 6N + 12·L·H·Q·T, N every parameter that multiplies (the output layer, which
    the token embedding shares, counted once; the position embedding is a lookup)."""
    with torch.device("meta"):
        net = GPT(GPTConfig())
    n = net.num_params() - net.transformer.wpe.weight.numel()
    layers, heads, head_dim, context = 12, 12, 64, 1024
    assert net.flops_per_token() == 6 * n + 12 * layers * heads * head_dim * context == 855_383_040


def test_adamw_is_fused_on_cuda_and_cpu_and_plain_on_mps():
    from config import OptimConfig
    from optimizer import build_optimizer
    net = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8))
    from plan import DEVICES
    assert build_optimizer(net, OptimConfig(), DEVICES["cuda"].fused_optimizer).defaults["fused"]
    assert build_optimizer(net, OptimConfig(), DEVICES["cpu"].fused_optimizer).defaults["fused"]
    assert not build_optimizer(net, OptimConfig(), DEVICES["mps"].fused_optimizer).defaults["fused"]


def test_training_attention_asks_sdpa_for_its_causal_path_without_a_mask(monkeypatch):
    """is_causal=True and no attn_mask: the call PyTorch serves with flash attention on GPUs."""
    calls = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((attn_mask, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    net = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8))
    x = torch.randint(0, 100, (2, 8))
    net(x, x).backward()
    assert calls == [(None, True), (None, True)]


def test_batches_go_to_the_gpu_from_pinned_memory_without_blocking(monkeypatch, tmp_path):
    from data import TokenLoader

    np.save(tmp_path / "train_000.npy", np.arange(40, dtype=np.uint16))
    loader = TokenLoader(str(tmp_path), "train", batch_size=2, block_size=8, device="cuda:0",
                         pin_memory=True)  # the device table's choice on CUDA
    copies = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: copies.append("pinned") or self)
    monkeypatch.setattr(
        torch.Tensor, "to", lambda self, device, non_blocking=False: copies.append((device, non_blocking)) or self
    )
    loader.next_batch()
    assert copies == ["pinned", ("cuda:0", True)]


def test_the_first_loss_draws_nothing_from_the_global_random_numbers():
    """The fused loss's one-time check draws its random rows from a generator of its own: a draw
    from the global one would shift dropout's numbers after a resume (the check runs at the
    first step of each process, step 11 for a run resumed at step 10)."""
    torch.manual_seed(1)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_embd=16, dropout=0.0))
    idx = torch.randint(0, 64, (2, 8))
    before = torch.get_rng_state()
    model(idx, idx)
    assert torch.equal(torch.get_rng_state(), before)
