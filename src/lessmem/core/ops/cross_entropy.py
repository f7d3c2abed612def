"""Cross-entropy over a large vocabulary that keeps nothing but its input.

A language model's loss is where long contexts run out of memory first: the usual
``F.cross_entropy(logits.float(), targets)`` keeps a float32 log-softmax of every token for backward
and makes two more of that size in it (on a 49k vocabulary: 0.56 MiB a token, more than thirty
LoRA-tuned decoder layers keep). This loss computes in float32 a chunk of rows at a time, in the
forward and again in the backward; it keeps the logits themselves (in their own dtype), the targets and
one float32 log-sum-exp per row, and its gradient is that of ``F.cross_entropy`` on the float32
logits to rounding. ``causal_lm_loss`` has the signature of HF transformers' causal-LM loss, so

    model.loss_function = lessmem.causal_lm_loss

makes an HF model's own loss this one (``lessmem.integrations.hf.use_chunked_loss`` finds the
model inside a PEFT wrapper).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# Bytes of float32 a chunk of rows takes at most (a few rows more for a vocabulary larger than it).
CHUNK_BYTES = 32 * 2**20


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, ignore_index: int, divisor: Tensor | None,
                rows: int) -> Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            block = logits[start:start + rows].float()
            lse[start:start + rows] = block_lse = torch.logsumexp(block, dim=1)
            target = targets[start:start + rows]
            picked = block.gather(1, target.clamp_min(0)[:, None]).squeeze(1)
            total += torch.where(target != ignore_index, block_lse - picked, 0.0).sum()
        count = (targets != ignore_index).sum() if divisor is None else divisor
        ctx.save_for_backward(logits, targets, lse, count)
        ctx.ignore_index, ctx.rows = ignore_index, rows
        return total / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        logits, targets, lse, count = ctx.saved_tensors
        scale = grad.float() / count
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            end = start + ctx.rows
            probs = logits[start:end].float().sub_(lse[start:end, None]).exp_()
            target = targets[start:end]
            kept = target != ctx.ignore_index
            probs[torch.arange(probs.shape[0], device=probs.device), target.clamp_min(0)] -= kept.float()
            grad_logits[start:end] = probs.mul_(kept[:, None] * scale)
        return grad_logits, None, None, None, None


def chunked_cross_entropy(logits: Tensor, targets: Tensor, *, ignore_index: int = -100,
                          divisor: Tensor | int | None = None) -> Tensor:
    """``F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)`` (the mean over the
    targets not ignored; the sum over ``divisor`` when given) for ``logits`` of shape (rows, classes),
    computed and differentiated in float32 a chunk of rows at a time; backward keeps only the logits,
    the targets and a float per row."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"lessmem: chunked_cross_entropy takes logits (rows, classes) and targets (rows,), "
                         f"got {tuple(logits.shape)} and {tuple(targets.shape)}")
    rows = max(1, CHUNK_BYTES // (4 * logits.shape[1]))
    count = None if divisor is None else torch.as_tensor(divisor, dtype=torch.float32, device=logits.device)
    return _ChunkedCrossEntropy.apply(logits, targets, ignore_index, count, rows)


def causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: Tensor | int | None = None,
                   ignore_index: int = -100, shift_labels: Tensor | None = None, **_: Any) -> Tensor:
    """HF transformers' ``ForCausalLMLoss`` (next-token cross-entropy; the sum over
    ``num_items_in_batch`` when the trainer gives it) by ``chunked_cross_entropy``."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    return chunked_cross_entropy(logits.reshape(-1, vocab_size), targets, ignore_index=ignore_index,
                                 divisor=num_items_in_batch)
