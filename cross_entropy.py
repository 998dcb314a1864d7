"""The output layer and the loss: the mean cross-entropy of the next token, two ways.

GPT.forward (model.py) hands its final hidden states here with the targets. "full" is nanoGPT's way:
the logits of every position, then F.cross_entropy. "chunked" computes the same loss a slice of rows at a
time, gradients included, so the (tokens x vocabulary) logits are never held at once: on a CPU that is
faster, on a GPU it saves their memory. `train.loss_path` chooses; both are tested to float tolerance.
"""

import torch
from torch.nn import functional as F


def next_token_loss(hidden, weight, targets, path="chunked"):
    """Mean cross-entropy of the logits `hidden @ weight.T` against `targets` (-1: not scored).
    hidden: (B, T, n_embd); weight: the output layer's (vocabulary, n_embd); targets: (B, T)."""
    hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    if path == "chunked":
        return chunked_cross_entropy(hidden, weight, targets)
    return from_logits(F.linear(hidden, weight), targets)


def from_logits(logits, targets):
    """Mean cross-entropy of logits (..., vocabulary) against targets (...), in float32; -1 is not scored."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)


# How many logits the chunked loss computes at once, by device type (why these sizes: docs/measurements.md).
# CPU: 16 MB of float32, small enough that each slice reuses the memory of the one before. CUDA: 2 GiB, so
# a GPT-2 micro-batch is a handful of slices, each big enough to fill the GPU.
LOSS_SLICE_VALUES = {"cpu": 2**22, "cuda": 2**29}


def loss_slice_rows(device_type, vocab_size):
    """Rows of hidden states per slice of the fused loss on this kind of device."""
    return max(1, LOSS_SLICE_VALUES.get(device_type, LOSS_SLICE_VALUES["cpu"]) // vocab_size)


def choose_loss_path(setting, device_type, compiled):
    """train.loss_path resolved to "chunked" or "full". "auto" picks the one measured fastest
    (docs/measurements.md): "full" under torch.compile on CUDA, where inductor fuses the softmax into the
    loss; "chunked" everywhere else, where it is as fast or faster and never holds the full logits."""
    if setting != "auto":
        return setting
    return "full" if device_type == "cuda" and compiled else "chunked"


def loss_slices(rows, vocab_size, device_type):
    """Slices per micro-step: the number of loop iterations torch.compile unrolls into the graph."""
    return -(-rows // loss_slice_rows(device_type, vocab_size))


class ChunkedCrossEntropy(torch.autograd.Function):
    """The output layer and the mean cross-entropy in one step, a slice of rows at a time.

    `F.cross_entropy(hidden @ weight.T, targets)` writes a (tokens x vocabulary) float32 tensor, reads
    it for the softmax, and writes its gradient again in the backward pass. Here each slice of rows
    computes its logits, its loss, and at once its gradients (softmax minus one-hot, divided by the
    number of scored tokens), then is thrown away; the backward pass only scales the stored gradients.
    The same sums as the full computation (tested to float tolerance, float32 and bf16 autocast),
    padded vocabulary rows included: they are rows of the tied embedding and get their true gradient.
    Targets of -1 are not scored (`ignore_index=-1`)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, need_grad):
        device_type = hidden.device.type
        # Under autocast the matmuls run in its dtype, as the unfused nn.Linear would; sums stay float32.
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        scored = targets != -1
        n_scored = scored.sum()
        with torch.autocast(device_type, enabled=False):
            w = weight.to(dtype)
            loss_sum = torch.zeros((), device=hidden.device)
            grad_hidden = torch.empty_like(hidden) if need_grad else None
            grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_grad else None
            for start in range(0, hidden.size(0), chunk_rows):
                h, t = hidden[start:start + chunk_rows].to(dtype), targets[start:start + chunk_rows]
                s, safe_t = scored[start:start + chunk_rows], t.clamp(min=0)
                logits = (h @ w.t()).float()
                target_logit = logits.gather(1, safe_t[:, None])
                # log-sum-exp with one exp pass, kept for the gradient: exp(logits - max) / its sum is the softmax.
                top = logits.amax(dim=1, keepdim=True)
                exp = logits.sub_(top).exp_()
                total = exp.sum(dim=1, keepdim=True)
                loss_sum += ((total.log() + top - target_logit).squeeze(1) * s).sum()
                if need_grad:  # d(mean loss)/d(logits) = (softmax - one_hot(target)) / n_scored
                    weight_of_row = s[:, None] / n_scored
                    g = exp.mul_(weight_of_row / total)
                    g.scatter_add_(1, safe_t[:, None], -weight_of_row)
                    g = g.to(dtype)
                    grad_hidden[start:start + chunk_rows] = g @ w
                    if dtype == torch.float32:
                        grad_weight.addmm_(g.t(), h)
                    else:
                        grad_weight += (g.t() @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss_sum / n_scored

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss, None, None, None


def chunked_cross_entropy(hidden, weight, targets):
    """Mean cross-entropy of `hidden @ weight.T` against `targets` (-1: not scored), never holding the
    full logits. hidden: (tokens, n_embd); weight: (vocabulary, n_embd); targets: (tokens,)."""
    # Whether a backward pass can follow is decided here: inside forward() grad mode is always off, and
    # ctx.needs_input_grad is True for a parameter even under torch.no_grad(). Without this, every
    # validation pass would also compute the gradients (twice the output layer's work, for nothing).
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return ChunkedCrossEntropy.apply(hidden, weight, targets, loss_slice_rows(hidden.device.type, weight.size(0)),
                                     need_grad)
