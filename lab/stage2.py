"""Two-stage training: a second stage on other data, regularised toward a frozen copy of the model.

    python train.py --stage2.start=3000steps --stage2.mix=python:1 --stage2.kl_beta=0.1

This is the JAX trainer's `KLDivergenceTrainer` for continued pretraining and domain adaptation:
stage 2 minimises CE + beta x KL(policy || reference), so the model learns the new data while being
pulled toward what it already knew (it forgets less). The reference is a frozen snapshot of the
model at the first step of stage 2 (or `stage2.reference`: a run or checkpoint folder, or GPT-2). It
runs in eval mode under no_grad and draws no random numbers, so beta = 0 trains exactly as a run
that only switches data.

- `nll_diff` (default, the JAX trainer's estimate): KL ~ CE(policy) - CE(reference) on the same
  batch, the reference's loss held constant. Cheap: one extra forward pass of the reference, no
  logits built.
- `full`: the exact token-level KL over GPT-2's 50,257 real tokens, from both models' logits.

The loop saves a `fixed` checkpoint at the stage boundary; a run resumed inside stage 2 rebuilds the
reference from it (the same weights the snapshot had), so resuming is exact. `train.Stages` is the
one place that crosses into stage 2: it imports this file then, and `begin_stage2` gives it stage
2's objective.
"""

import copy
import functools
import os

import torch
from torch.nn import functional as F

from checkpoint import (CheckpointError, check_named_module, check_source, check_weights_fit,
                        gpt_class,
                        load_model, read_trainer_state, saved_weights, verify_checkpoint)
from config import config_from_dict
from data import GPT2_VOCAB_SIZE


def full_kl(logits, reference_logits, targets):
    """Mean over the scored tokens of sum_v p(v) (log p(v) - log q(v)), p the policy, q the
    reference."""
    log_p = F.log_softmax(logits[..., :GPT2_VOCAB_SIZE].float(), dim=-1)
    log_q = F.log_softmax(reference_logits[..., :GPT2_VOCAB_SIZE].float(), dim=-1)
    per_token = (log_p.exp() * (log_p - log_q)).sum(-1)
    scored = targets != -1
    return (per_token * scored).sum() / scored.sum()


def stage2_loss(model, x, y, reference, beta, estimator):
    """(objective, cross-entropy, kl, reference_loss) for one micro-batch of stage 2. The exact KL
    ("full") needs both models' logits; "nll_diff" needs only their losses, so the logits are never
    built."""
    if estimator == "full":
        logits = model(x)
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1),
                             ignore_index=-1)
        with torch.no_grad():
            reference_logits = reference(x)
        vocab = reference_logits.size(-1)
        reference_loss = F.cross_entropy(reference_logits.reshape(-1, vocab).float(), y.reshape(-1),
                                         ignore_index=-1)
        kl = full_kl(logits, reference_logits, y)
    else:
        ce = model(x, y)
        with torch.no_grad():
            reference_loss = reference(x, y)
        kl = ce - reference_loss
    return ce + beta * kl, ce, kl, reference_loss


def check_reference(source, model_cfg, estimator, model_module="model"):
    """stage2.reference at start, since stage 2 may begin hours later: a model load_model can load
    into this run's class (`model_module`: a file the reference's checkpoint names is never
    imported), whose weights fit it, that reads this run's sequences (block_size) and predicts its
    tokens: GPT-2's (a vocabulary of 50,257 or padded past it) or characters, at least as many
    (`estimator` full: as many). One sentence otherwise. Shapes and configs are read, not weights.
    """
    path = check_source(source, "stage2.reference")
    if path is None:  # a GPT-2 name or a Hugging Face folder (hf.py)
        from lab.hf import gpt2_shape
        shape = gpt2_shape(source)
    else:
        cfg = config_from_dict(read_trainer_state(path)["config"])
        check_named_module(cfg.train.model_module, model_module, f"stage2.reference={source}",
                           "--train.model_module")
        with torch.device("meta"):  # its shapes, no memory (the run's class: main checked it)
            model = gpt_class(model_module)(cfg.model)
        check_weights_fit(path, model, "give stage2.reference a checkpoint of the model as its "
                                       "code is now.")
        shape = {"block_size": cfg.model.block_size, "vocab_size": cfg.model.vocab_size}
    theirs = min(shape["vocab_size"], GPT2_VOCAB_SIZE)
    ours = min(model_cfg.vocab_size, GPT2_VOCAB_SIZE)
    # GPT-2's tokens on both sides or on neither; `full` compares whole distributions, nll_diff
    # scores our ids
    tokens = (theirs == GPT2_VOCAB_SIZE) == (ours == GPT2_VOCAB_SIZE) and (
        theirs == ours if estimator == "full" else theirs >= ours)
    if shape["block_size"] < model_cfg.block_size or not tokens:
        raise CheckpointError(f"stage2.reference={source} reads {shape['block_size']} tokens at "
                              f"most and predicts {shape['vocab_size']}, and this run's "
                              f"model.block_size is {model_cfg.block_size} and its "
                              f"model.vocab_size {model_cfg.vocab_size}; give a reference trained "
                              "on this run's sequences and tokenizer.")


def make_reference(stage2_cfg, raw_model, out_dir, start_step, device, resuming_inside,
                   model_module="model"):
    """The frozen reference: stage2.reference if given (built by this run's `model_module`); else
    the model at the stage boundary, copied now when the loop crosses it, or read back from the
    boundary checkpoint into a copy of the model when resuming inside stage 2."""
    # Building a model initialises weights with the global RNG; the fork keeps training's RNG
    # untouched, so dropout masks are the same whether the reference was copied or rebuilt on
    # resume.
    cuda = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        if stage2_cfg.reference:
            reference = load_model(stage2_cfg.reference, device, "stage2.reference", model_module,
                                   "--train.model_module")
        else:
            reference = copy.deepcopy(raw_model)
            if resuming_inside:
                boundary = os.path.join(out_dir, f"step{start_step}")
                verify_checkpoint(boundary)
                reference.load_state_dict(saved_weights(boundary, reference, device))
    reference.eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


def begin_stage2(stages):
    """Stage 2's objective, at its first step in this process (`stages`: the run's train.Stages),
    for train.train_step: `objective(model, x, y)` gives (CE + beta x KL, CE, KL, the reference's
    loss)."""
    # sources both stages read continue where they were
    if len(stages.loaders) > 1 and not stages.resumed_inside:
        stages.loaders[1][1].load_state_dict(stages.loaders[0][1].state_dict())
    reference = make_reference(stages.cfg, stages.raw_model, stages.out_dir, stages.stage2_step,
                               stages.device,
                               stages.resumed_inside, stages.model_module)
    return functools.partial(stage2_loss, reference=reference, beta=stages.cfg.kl_beta,
                             estimator=stages.cfg.kl_estimator)
