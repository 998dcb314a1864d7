"""optimizer.py: AdamW, or Muon for the blocks' matrices beside AdamW for the rest; in the loop, in
checkpoints, under DDP, in the dry run and in the metrics."""

import pytest
import torch

from config import ConfigError, OptimConfig, parse_args
from conftest import TINY, read_metrics, run_train
from model import GPT, GPTConfig
import optimizer as optimizer_module
from optimizer import MuonAdamW, build_optimizer, param_groups, set_lr


def tiny():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))


def test_muon_owns_the_block_matrices_and_adamw_the_rest():
    net = tiny()
    groups = param_groups(net, OptimConfig(name="muon"))
    blocks = [p for block in net.transformer.h for p in block.parameters() if p.dim() == 2]
    assert {id(p) for p in groups["muon"]} == {id(p) for p in blocks}  # c_attn, c_proj, c_fc, mlp.c_proj per block
    decayed = {id(p) for p in groups["decay"]}
    assert id(net.transformer.wte.weight) in decayed and id(net.transformer.wpe.weight) in decayed
    assert all(p.dim() == 1 for p in groups["no_decay"])  # biases and LayerNorm gains
    assert sum(len(g) for g in groups.values()) == len(list(net.parameters()))  # every parameter once
    assert "muon" not in param_groups(net, OptimConfig(name="adamw"))


def test_each_group_follows_the_schedule_from_its_own_peak():
    net = tiny()
    optimizer = build_optimizer(net, OptimConfig(name="muon", lr=1e-3, muon_lr=0.02))
    assert isinstance(optimizer, MuonAdamW) and isinstance(optimizer.optimizers["muon"], torch.optim.Muon)
    lrs = set_lr(optimizer, 5e-4, peak_lr=1e-3)  # the schedule at half its peak, as each group read it back
    assert lrs == {"optim/lr": 5e-4, "optim/lr/muon": 0.01, "optim/lr/adamw": 5e-4, "optim/lr/adamw_no_decay": 5e-4}
    same = build_optimizer(net, OptimConfig(name="muon", lr=1e-3))  # muon_lr 0: optim.lr (RMS-matched)
    assert same.optimizers["muon"].param_groups[0]["lr"] == 1e-3


def test_a_muon_step_orthogonalizes_the_matrices_update():
    """Muon's update of a matrix has all its singular values near one size (Newton-Schulz), unlike the gradient's."""
    net = tiny()
    optimizer = build_optimizer(net, OptimConfig(name="muon", lr=1.0, muon_weight_decay=0.0))
    x = torch.randint(0, 100, (4, 16))
    net(x, x).backward()
    weight = net.transformer.h[0].mlp.c_fc.weight
    before, gradient = weight.detach().clone(), weight.grad.clone()
    optimizer.step()
    update = torch.linalg.svdvals((before - weight.detach()).float())
    gradient = torch.linalg.svdvals(gradient)

    def spread(values):  # the ratio of the 90th to the 10th percentile of the singular values
        return (values.quantile(0.9) / values.quantile(0.1)).item()
    assert spread(update) < 2 < 10 < spread(gradient)


def test_on_a_cpu_muon_is_torchs_muon_with_newton_schulz_in_float32(monkeypatch):
    """optimizer.Muon's CPU step is torch.optim.Muon's, its Newton-Schulz iterations in float32 instead of bfloat16
    (which a CPU without bfloat16 units multiplies many times slower): the same state, and bit for bit the same
    update as torch's once torch's iteration is made float32."""
    import torch.optim._muon as torch_muon

    def newton_schulz_in_float32(grad, coefficients, steps, eps):  # torch's iteration, its bfloat16 cast removed
        a, b, c = coefficients
        x = grad.float().T if grad.size(0) > grad.size(1) else grad.float()
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if grad.size(0) > grad.size(1) else x

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(shape)) for shape in ((96, 32), (32, 96))]
    ours = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    ours_opt = optimizer_module.Muon(ours, **settings)
    bf16_opt = torch.optim.Muon([torch.nn.Parameter(w.detach().clone()) for w in weights], **settings)
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", newton_schulz_in_float32)
    torch_opt = torch.optim.Muon(weights, **settings)
    for _ in range(3):
        grads = [torch.randn_like(w) for w in weights]
        for params, opt in ((weights, torch_opt), (ours, ours_opt)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        for p, g in zip(bf16_opt.param_groups[0]["params"], grads):
            p.grad = g.clone()
        monkeypatch.undo()
        bf16_opt.step()  # torch's own, in bfloat16
        monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", newton_schulz_in_float32)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ours, weights))
    assert ours_opt.state_dict()["state"].keys() == torch_opt.state_dict()["state"].keys() == {0, 1}
    assert not any(torch.equal(a, b) for a, b in zip(ours, bf16_opt.param_groups[0]["params"]))


def test_two_gloo_ranks_match_one_rank_with_accumulation_under_muon(data_root, tmp_path):
    """DDP all-reduces the gradients before the step, so each rank's Muon update of a whole matrix is the same."""
    common = TINY + [f"--data.data_root={data_root}", "--train.max_steps=4", "--eval.interval=0",
                     "--train.total_batch_size=256", "--optim.name=muon"]
    run_train(common + [f"--train.out_dir={tmp_path / 'one'}"])
    run_train(common + [f"--train.out_dir={tmp_path / 'two'}"], nproc=2)
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]  # zip ends at the shorter run
    for a, b in zip(one, two):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4)
    assert one[-1]["train/loss"] < one[0]["train/loss"]


def test_muon_resumes_exactly_and_logs_each_groups_lr(data_root, tmp_path):
    common = TINY + [f"--data.data_root={data_root}", "--train.max_steps=8", "--eval.interval=0", "--optim.name=muon",
                     "--checkpoint.interval=4", "--model.dropout=0.1"]
    run_train(common + [f"--train.out_dir={tmp_path / 'full'}"])
    run_train(common + [f"--train.out_dir={tmp_path / 'split'}", "--train.hard_stop=4"])
    run_train(common + [f"--train.out_dir={tmp_path / 'split'}"])
    full, split = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "split")
    assert [r["train/loss"] for r in split] == [r["train/loss"] for r in full]  # both optimizers' states came back
    assert {"optim/lr/muon", "optim/lr/adamw", "optim/lr/adamw_no_decay"} <= set(full[-1])


def test_resuming_with_the_other_optimizer_is_refused_before_anything_is_loaded(data_root, tmp_path):
    out = tmp_path / "run"
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=2"])
    before = sorted(p.name for p in out.iterdir())
    refused = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={out}", "--train.max_steps=4",
                                "--optim.name=muon"], check=False)
    assert refused.returncode == 1 and "optim.name='adamw' and this run has optim.name='muon'" in refused.stderr
    assert sorted(p.name for p in out.iterdir()) == before
    fine_tune = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'new'}",
                                  f"--checkpoint.load_path={out}", "--train.max_steps=4", "--optim.name=muon"],
                          check=False)
    assert fine_tune.returncode == 1 and "set --checkpoint.load_optim=false" in fine_tune.stderr
    run_train(
        TINY
        + [
            f"--data.data_root={data_root}",
            f"--train.out_dir={tmp_path / 'new'}",
            f"--checkpoint.load_path={out}",
            "--train.max_steps=4",
            "--optim.name=muon",
            "--checkpoint.load_optim=false",
        ]
    )


def test_compare_state_names_both_optimizers_moments(data_root, tmp_path):
    from lab import debug
    run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--train.max_steps=2",
                      "--optim.name=muon"])
    _, state = debug.named_state(str(tmp_path))
    assert "optim/transformer.h.0.attn.c_attn.weight/momentum_buffer" in state  # Muon's
    assert "optim/transformer.wte.weight/exp_avg" in state  # AdamW's


def test_the_quick_start_trains_the_blocks_matrices_with_muon_and_the_rest_with_adamw(data_root, tmp_path):
    # `python train.py` as the README gives it (config/shakespeare.py), planned but not run
    result = run_train([f"--data.data_root={data_root}", f"--train.out_dir={tmp_path / 'run'}", "--dry_run"])
    lines = [line for line in result.stdout.splitlines() if line.startswith("optimizer: ")]
    assert lines[0] == ("optimizer: Muon: 786,432 parameters in 16 block matrices, LR 0.01, weight decay 0.1, "
                        "momentum 0.95")
    assert lines[1].startswith("optimizer: AdamW: 6,455,296 parameters with weight decay 0.1")
    assert "LR 0.005" in lines[1]
    assert "run: 300 steps x 1,024 tokens" in result.stdout and not (tmp_path / "run").exists()


def test_the_dry_run_says_which_optimizer_owns_what(data_root, tmp_path):
    result = run_train(TINY + [f"--data.data_root={data_root}", f"--train.out_dir={tmp_path}", "--optim.name=muon",
                               "--dry_run"])
    lines = [line for line in result.stdout.splitlines() if line.startswith("optimizer: ")]
    assert lines[0].startswith("optimizer: Muon: 24,576 parameters in 8 block matrices")
    assert lines[1].startswith("optimizer: AdamW: ")


def test_muon_settings_are_checked():
    with pytest.raises(ConfigError, match="optim.name='lion' is not one of adamw, muon"):
        parse_args(["--optim.name=lion"])
    with pytest.raises(ConfigError, match="optim.muon_momentum must be in"):
        parse_args(["--optim.muon_momentum=1.5"])
