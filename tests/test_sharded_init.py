"""Sharded initialisation's record and replay (fsdp.build_on_meta, materialise) in one process, without sharding:
the replayed weights equal a whole build's from the same seed, the random state is left as it was, and an init the
record cannot replay is said so (build_for_fsdp then builds the model whole). The 2-rank test is in test_fsdp.py."""

import torch
import torch.nn as nn

from model import GPT, GPTConfig
from lab.fsdp import build_for_fsdp, build_on_meta, materialise

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=96)


def test_the_replayed_weights_equal_a_whole_build_from_the_same_seed():
    torch.manual_seed(5)
    whole = GPT(CONFIG)
    model, record = build_on_meta(lambda: GPT(CONFIG))
    assert record.unreplayable == "" and all(p.is_meta for p in model.parameters())
    torch.manual_seed(123)
    state = torch.get_rng_state()
    materialise(model, record, seed=5, device="cpu")
    assert torch.equal(torch.get_rng_state(), state)  # the run's own random state is untouched
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert all(torch.equal(tensor, model.state_dict()[name]) for name, tensor in whole.state_dict().items())


class Computed(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.02)  # computed from another tensor: not replayed


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4).normal_())
        self.register_buffer("table", torch.arange(4.0))


def test_an_init_the_record_cannot_replay_is_said_so():
    assert "computed from other tensors" in build_on_meta(Computed)[1].unreplayable
    assert build_on_meta(WithBuffer)[1].unreplayable == "the model has buffers"


def test_a_model_whose_init_cannot_be_replayed_is_built_whole_and_the_run_says_so(capsys):
    model, record = build_for_fsdp(WithBuffer, "cpu", is_master=True)
    assert record is None and not any(p.is_meta for p in model.parameters())
    assert "built whole on every rank before it is sharded (the model has buffers" in capsys.readouterr().out
