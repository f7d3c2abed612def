"""MaxPool2d that keeps the argmax position inside each window as uint8 (exact): the autograd
Function and the swapped-in ``CompactMaxPool2d``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.ops.dispatch import needs_saving
from lessmem.core.ops.owned_grad import grad_target, handed_to


class CompactMaxPool2dFunction(torch.autograd.Function):
    """max_pool2d that saves the argmax position inside each window as uint8 (not the input and
    int64 plane indices, as stock does). The gradient is scattered exactly like stock, into a
    fresh tensor handed to the node before (``owned_grad``)."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        h, w = x.shape[-2:]
        ctx.geometry = (kernel, stride, padding, dilation, (h, w), tuple(x.shape))
        ctx.grad_target = grad_target(x)
        out_hw = [_pooled_size(*a, ceil_mode) for a in zip((h, w), kernel, stride, padding, dilation, strict=True)]
        # arguments stock would reject (padding over half the kernel, empty output) take the stock
        # path below, which raises its own error
        valid = all(p <= k // 2 for p, k in zip(padding, kernel, strict=True)) and min(out_hw) > 0
        ctx.fused = valid and x.dim() == 4 and x.is_contiguous() and cpu_kernels.enabled_for(x)
        if ctx.fused:
            out, local = cpu_kernels.max_pool_compact(x, kernel, stride, padding, dilation, out_hw)
            ctx.save_for_backward(local)
            return out
        out, idx = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        row0, col0 = _window_origins(out.shape[-2:], stride, padding, x.device)
        flat = idx.to(torch.int32)  # int32 arithmetic: half the memory traffic of int64
        r = flat // w
        col_off, row_off = flat.sub_(r * w).sub_(col0), r.sub_(row0)  # argmax offset in its window
        if dilation != (1, 1):
            col_off, row_off = col_off // dilation[1], row_off // dilation[0]
        local = row_off.mul_(kernel[1]).add_(col_off)
        ctx.save_for_backward(local.to(torch.uint8))
        return out

    @staticmethod
    def backward(ctx, grad):
        (local,) = ctx.saved_tensors
        kernel, stride, padding, dilation, (h, w), shape = ctx.geometry
        if ctx.fused:
            gx = cpu_kernels.max_pool_compact_backward(grad, local, kernel, stride, padding, dilation, (h, w))
            return handed_to(gx, ctx.grad_target), None, None, None, None, None
        row0, col0 = _window_origins(grad.shape[-2:], stride, padding, grad.device)
        # plane index = window origin + offset of the argmax inside the window (a small table)
        i = torch.arange(kernel[0], device=grad.device)[:, None] * dilation[0]
        j = torch.arange(kernel[1], device=grad.device)[None, :] * dilation[1]
        offsets = (i * w + j).flatten()
        idx = (offsets[local.long()] + (row0 * w + col0)).flatten(-2)
        gx = grad.new_zeros(*shape[:-2], h * w)
        gx.scatter_add_(-1, idx, grad.flatten(-2))
        return handed_to(gx.view(shape), ctx.grad_target), None, None, None, None, None


def _pooled_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """Output length of max-pooling along one axis, as PyTorch computes it."""
    span = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = span // s + 1
    if ceil_mode and (out - 1) * s >= size + p:  # the last window must start inside the input
        out -= 1
    return out


def _window_origins(out_hw, stride: tuple[int, int], padding: tuple[int, int], device) -> tuple[Tensor, Tensor]:
    rows = torch.arange(out_hw[0], device=device) * stride[0] - padding[0]
    cols = torch.arange(out_hw[1], device=device) * stride[1] - padding[1]
    return rows[:, None], cols[None, :]


class CompactMaxPool2d(nn.MaxPool2d):
    """MaxPool2d that keeps uint8 in-window argmax positions, not its input and int64 indices."""

    def forward(self, x: Tensor) -> Tensor:
        kernel, dilation = _pair(self.kernel_size), _pair(self.dilation)
        if (
            not needs_saving(x, self)
            or self.return_indices
            or kernel[0] * kernel[1] > 256
            or x.dim() != 4
        ):
            return super().forward(x)
        stride = _pair(self.stride if self.stride is not None else self.kernel_size)
        return CompactMaxPool2dFunction.apply(
            x, kernel, stride, _pair(self.padding), dilation, self.ceil_mode
        )
