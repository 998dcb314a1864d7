"""The optimizer: AdamW (GPT-2's), or Muon for the transformer's matrices beside AdamW for the rest.

    optim.name = "adamw"   AdamW over every parameter (GPT-3, nanoGPT): the default
    optim.name = "muon"    Muon (Jordan et al. 2024; PyTorch's torch.optim.Muon) for the 2-D weights of the
                           transformer blocks, AdamW for the token and position embeddings (the token
                           embedding is the output layer too), biases and LayerNorm gains: the split of
                           modded-nanogpt, nanochat's MuonAdamW and OLMo-core's muon ladder

Muon orthogonalizes each matrix's momentum with a few Newton-Schulz iterations, so every direction of
the update moves by about the same amount. With Moonshot's scaling (`adjust_lr_fn="match_rms_adamw"`,
Liu et al. 2025, "Muon is Scalable for LLM Training") its update has AdamW's size, so both take the
same learning rate, as OLMo-core's muon ladder does; `optim.muon_lr` may set Muon's apart.

Every parameter group carries a `name` and its `peak_lr`: `set_lr` scales each group's peak by the
schedule, and the loop logs each group's LR as optim/lr/<name>.
"""

import inspect

import torch


def param_groups(model, optim):
    """{group name: [parameters]}: which optimizer owns what (the dry run prints this)."""
    # Decay the matrices (weights of matmuls and embeddings), not biases or LayerNorm gains: shrinking
    # those towards zero only hurts (as in GPT-3 and nanoGPT). optim.decay_embeddings=false also spares
    # the embeddings (OLMo-core's ladder); the token embedding is the output layer too (tied weights),
    # so it is spared as a whole.
    embeddings = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
    params = [p for p in model.parameters() if p.requires_grad]
    block_matrices = {id(p) for block in model.transformer.h for p in block.parameters() if p.dim() == 2}
    groups = {"muon": [], "decay": [], "no_decay": []}
    for p in params:
        if optim.name == "muon" and id(p) in block_matrices:
            groups["muon"].append(p)
        elif p.dim() >= 2 and (optim.decay_embeddings or id(p) not in embeddings):
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    return {name: group for name, group in groups.items() if group or name != "muon"}


def build_optimizer(model, optim, device_type):
    """AdamW, or MuonAdamW, over `model` from the `optim` config section."""
    groups = param_groups(model, optim)
    # The fused kernel updates all tensors in one launch on CUDA; it does not exist on CPU.
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    adamw = torch.optim.AdamW(
        [{"params": groups["decay"], "weight_decay": optim.weight_decay, "name": "adamw", "peak_lr": optim.lr},
         {"params": groups["no_decay"], "weight_decay": 0.0, "name": "adamw_no_decay", "peak_lr": optim.lr}],
        lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **({"fused": True} if fused else {}))
    if optim.name == "adamw":
        return adamw
    muon_lr = optim.muon_lr or optim.lr
    muon = torch.optim.Muon([{"params": groups["muon"], "name": "muon", "peak_lr": muon_lr}], lr=muon_lr,
                            weight_decay=optim.muon_weight_decay, momentum=optim.muon_momentum, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    return MuonAdamW(muon, adamw)


class MuonAdamW:
    """Muon and AdamW stepped as one optimizer (nanochat's MuonAdamW): the loop, the checkpoint and the
    schedule see one object. Gradients are all-reduced by DDP before `step`, so every rank computes the
    same update of the whole matrix."""

    name = "muon"  # optim.name: what a checkpoint's optimizer state belongs to

    def __init__(self, muon, adamw):
        self.optimizers = {"muon": muon, "adamw": adamw}

    @property
    def param_groups(self):
        return [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def step(self):
        for optimizer in self.optimizers.values():
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {name: optimizer.state_dict() for name, optimizer in self.optimizers.items()}

    def load_state_dict(self, state):
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state[name])


def set_lr(optimizer, lr, peak_lr):
    """The schedule's LR for this step (`lr`, of a schedule peaking at `peak_lr`) applied to every group:
    each group keeps its own peak and follows the same curve."""
    for group in optimizer.param_groups:
        group["lr"] = group["peak_lr"] * lr / peak_lr


def lr_metrics(optimizer):
    """optim/lr/<group>: the LR each group used this step, read from the optimizer itself; optim/lr is the
    main AdamW group's (the schedule's LR when the config in force is what the optimizer uses)."""
    lrs = {f"optim/lr/{group['name']}": group["lr"] for group in optimizer.param_groups}
    return {"optim/lr": lrs["optim/lr/adamw"], **lrs}


def describe_optimizer(model, optim):
    """One line per optimizer: the groups it owns and their parameter counts (for --dry_run)."""
    groups = param_groups(model, optim)
    count = {name: sum(p.numel() for p in params) for name, params in groups.items()}
    lines = []
    if "muon" in groups:
        lines.append(f"Muon: {count['muon']:,} parameters in {len(groups['muon'])} block matrices, LR "
                     f"{optim.muon_lr or optim.lr:g}, weight decay {optim.muon_weight_decay:g}, momentum "
                     f"{optim.muon_momentum:g}")
    lines.append(f"AdamW: {count['decay']:,} parameters with weight decay {optim.weight_decay:g} "
                 f"({len(groups['decay'])} tensors), {count['no_decay']:,} without ({len(groups['no_decay'])}), LR "
                 f"{optim.lr:g}, betas ({optim.beta1:g}, {optim.beta2:g})")
    return lines
