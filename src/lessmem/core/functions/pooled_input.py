"""What the pooled conv and linear Functions keep on ``ctx``, saved and read back one way."""

from __future__ import annotations

from torch import Tensor

from lessmem.core.storage import Storage, unpack_tensor


def save_pooled_input(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, packed: tuple[Tensor, ...],
                      storage: Storage) -> None:
    """What the pooled conv / linear functions keep: the weight and the packed pooled input
    (empty when no weight gradient is wanted) as saved tensors, shapes and flags on ctx."""
    ctx.save_for_backward(weight, *packed)
    ctx.storage, ctx.x_meta, ctx.has_bias = storage, (tuple(x.shape), x.dtype), bias is not None


def saved_pooled_input(ctx) -> tuple[Tensor, Tensor | None, tuple[int, ...], tuple[bool, bool, bool]]:
    """(weight, pooled input or None, input shape, which of input / weight / bias gradients)."""
    weight, *packed = ctx.saved_tensors
    shape, dtype = ctx.x_meta
    pooled = unpack_tensor(packed, ctx.storage, dtype) if packed else None
    return weight, pooled, shape, (ctx.needs_input_grad[0], bool(packed), ctx.has_bias and ctx.needs_input_grad[2])
