"""What the pooled conv and linear Functions keep on ``ctx``, saved and read back one way."""

from __future__ import annotations

from torch import Tensor

from lessmem.core.storage import Storage, TensorMeta, unpack_tensor


def save_pooled_input(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, packed: tuple[tuple[Tensor, ...], TensorMeta] | None,
                      storage: Storage) -> None:
    """What the pooled conv / linear functions keep: the weight and the packed pooled input
    (None when no weight gradient is wanted) as saved tensors, shapes and flags on ctx."""
    tensors, ctx.pooled_meta = packed if packed is not None else ((), None)
    ctx.save_for_backward(weight, *tensors)
    ctx.storage, ctx.x_shape, ctx.has_bias = storage, tuple(x.shape), bias is not None


def saved_pooled_input(ctx) -> tuple[Tensor, Tensor | None, tuple[int, ...], tuple[bool, bool, bool]]:
    """(weight, pooled input or None, input shape, which of input / weight / bias gradients)."""
    weight, *packed = ctx.saved_tensors
    pooled = unpack_tensor(packed, ctx.storage, ctx.pooled_meta) if packed else None
    return weight, pooled, ctx.x_shape, (ctx.needs_input_grad[0], bool(packed), ctx.has_bias and ctx.needs_input_grad[2])
