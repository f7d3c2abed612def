"""GELU / SiLU with a lower-precision copy of the input (approximate, opt-in)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lessmem.core.storage import pack_tensor, tensor_meta, unpack_tensor


class StoredActivationFunction(torch.autograd.Function):
    """GELU or SiLU that keeps its input as bf16 or 8-bit per-feature codes.

    Approximate: the derivative is evaluated at the dequantized input, so the input gradient is
    no longer exact. Opt-in through ``compress(..., act_storage=...)``.
    """

    @staticmethod
    def forward(ctx, x, kind, approximate, storage):
        out = F.gelu(x, approximate=approximate) if kind == "gelu" else F.silu(x)
        ctx.save_for_backward(*pack_tensor(x.detach(), storage))
        ctx.kind, ctx.approximate, ctx.storage, ctx.meta = kind, approximate, storage, tensor_meta(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        x = unpack_tensor(ctx.saved_tensors, ctx.storage, ctx.meta)
        if ctx.kind == "gelu":
            gx = torch.ops.aten.gelu_backward(grad, x, approximate=ctx.approximate)
        else:
            gx = torch.ops.aten.silu_backward(grad, x)
        return gx, None, None, None
