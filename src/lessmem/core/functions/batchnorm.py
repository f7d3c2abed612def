"""BatchNorm with a lower-precision copy of its input (approximate, opt-in)."""

from __future__ import annotations

import torch

from lessmem.core.storage import pack_tensor, tensor_meta, unpack_tensor


class StoredBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm that keeps its input as bf16 or 8-bit codes instead of fp32.

    Approximate: the input gradient uses the dequantized input, so error propagation is no longer
    exact. Opt-in through ``norm_storage``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, storage):
        out, mean, invstd = torch.ops.aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, True, momentum, eps
        )
        ctx.save_for_backward(weight, mean, invstd, *pack_tensor(x.detach(), storage))
        ctx.eps, ctx.storage, ctx.meta = eps, storage, tensor_meta(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, mean, invstd, *packed = ctx.saved_tensors
        x = unpack_tensor(packed, ctx.storage, ctx.meta)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad.contiguous(), x, weight, None, None, mean, invstd, True, ctx.eps, mask
        )
        return gx, gw, gb, None, None, None, None, None
