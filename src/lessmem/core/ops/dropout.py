"""Dropout with a 1-bit keep-mask (exact): the autograd Function and the swapped-in
``PackedDropout``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lessmem.core.ops.dispatch import needs_saving
from lessmem.core.ops.masked_activations import pack_bits, unpack_bits


class PackedDropoutFunction(torch.autograd.Function):
    """Dropout that keeps its keep-mask as bits, not the fp32 noise tensor stock CPU autograd
    keeps. The random draws and arithmetic repeat stock's, so outputs and gradients are
    bit-identical to ``nn.Dropout`` under the same RNG state."""

    @staticmethod
    def forward(ctx, x, p):
        if x.device.type == "cpu":
            # aten::_dropout_impl on CPU: noise = bernoulli(1 - p) / (1 - p); out = x * noise.
            noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
            out = x * noise
            keep = noise != 0
        else:
            # Accelerators use the fused kernel, with the same (output, bool mask) contract.
            out, keep = torch.ops.aten.native_dropout(x, p, True)
        ctx.save_for_backward(pack_bits(keep))
        ctx.shape, ctx.p = keep.shape, p
        return out

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        keep = unpack_bits(packed, ctx.shape)
        if grad.device.type == "cpu":
            # Rebuild the noise values exactly as forward made them (same ops, same rounding).
            scale = grad.new_ones(()).div_(1 - ctx.p)
            return grad * torch.where(keep, scale, grad.new_zeros(())), None
        return torch.ops.aten.native_dropout_backward(grad, keep, 1.0 / (1 - ctx.p)), None


class PackedDropout(nn.Dropout):
    """nn.Dropout that keeps 1 bit per element for backward (exact)."""

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and 0.0 < self.p < 1.0 and not self.inplace and needs_saving(x, self)):
            return super().forward(x)
        return PackedDropoutFunction.apply(x, self.p)
