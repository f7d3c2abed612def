"""Autograd functions whose forward is exact but whose saved tensors are compressed.

Every tensor that backward needs goes through ``ctx.save_for_backward`` so that saved-tensor hooks
(``measure_memory``, checkpointing, offloading) see it; only shapes and scalars live on ``ctx``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .storage import Storage, pack_tensor, unpack_tensor

Pair = tuple[int, int]

# ---------------------------------------------------------------------------------------------
# Pooling helpers
# ---------------------------------------------------------------------------------------------


def pool_blocks(x: Tensor, kernel: Pair) -> Tensor:
    """k×k block means. ``ceil_mode`` keeps partial edge blocks, averaged over their true size."""
    return F.avg_pool2d(x, kernel, stride=kernel, ceil_mode=True)


def expand_blocks(pooled: Tensor, kernel: Pair, size: Pair) -> Tensor:
    """Inverse layout of ``pool_blocks``: repeat each mean over its block, cropped to ``size``."""
    n, c, h, w = pooled.shape
    kh, kw = kernel
    full = pooled[:, :, :, None, :, None].expand(n, c, h, kh, w, kw).reshape(n, c, h * kh, w * kw)
    return full[:, :, : size[0], : size[1]]


def pool_tokens(x: Tensor, k: int) -> Tensor:
    """Means of groups of ``k`` consecutive tokens along dim -2 (partial last group kept)."""
    return F.avg_pool1d(x.transpose(-1, -2).reshape(-1, 1, x.shape[-2]), k, k, ceil_mode=True).view(
        *x.shape[:-2], x.shape[-1], -1
    ).transpose(-1, -2)


def expand_tokens(pooled: Tensor, k: int, tokens: int) -> Tensor:
    return pooled.repeat_interleave(k, dim=-2)[..., :tokens, :]


# Pooled copies of one input shared by several layers (ResNet's conv1 and downsample both read the
# block input): the second layer reuses the first one's tensor, so it is stored once.
_CACHE_ATTR = "_lessmem_pooled"


def pooled_once(x: Tensor, kernel: Pair, storage: Storage) -> tuple[Tensor, ...]:
    if torch.compiler.is_compiling():  # the compiler de-duplicates; tensor attributes would break graphs
        return pack_tensor(pool_blocks(x.detach(), kernel), storage)
    key = (kernel, storage, x._version)
    cache = getattr(x, _CACHE_ATTR, None)
    if cache is not None and key in cache:
        return cache[key]
    packed = pack_tensor(pool_blocks(x.detach(), kernel), storage)
    if cache is None or next(iter(cache))[2] != x._version:
        cache = {}
        setattr(x, _CACHE_ATTR, cache)
    cache[key] = packed
    return packed


# ---------------------------------------------------------------------------------------------
# Convolution
# ---------------------------------------------------------------------------------------------


class PooledConv2dFunction(torch.autograd.Function):
    """conv2d whose input is saved only as k×k block means.

    Backward: the input gradient needs only the weight, so it is exact; the weight gradient is
    computed from the block means repeated over each block (the paper's approximation).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, kernel, storage):
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        packed = pooled_once(x, kernel, storage) if ctx.needs_input_grad[1] else ()
        ctx.save_for_backward(weight, *packed)
        ctx.conv = (stride, padding, dilation, groups)
        ctx.kernel, ctx.storage = kernel, storage
        ctx.x_meta = (tuple(x.shape), x.dtype)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, *packed = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        shape, dtype = ctx.x_meta
        if packed:
            x_hat = expand_blocks(unpack_tensor(packed, ctx.storage, dtype), ctx.kernel, shape[2:])
        else:  # no weight gradient wanted: only the shape of the input matters
            x_hat = grad_out.new_empty(()).expand(shape)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2])
        gx, gw, gb = conv_grads(grad_out, x_hat, weight, ctx.has_bias, stride, padding, dilation, groups, needs)
        return gx, gw, gb, None, None, None, None, None, None


def conv_grads(grad_out, x_hat, weight, has_bias, stride, padding, dilation, groups, needs):
    """(input, weight, bias) gradients of conv2d, the weight gradient taken on ``x_hat``. The
    input gradient reads only the weight, so it is exact whatever ``x_hat`` is."""
    return torch.ops.aten.convolution_backward(
        grad_out, x_hat, weight, [weight.shape[0]] if has_bias else None,
        stride, padding, dilation, False, [0, 0], groups, list(needs),
    )


def linear_grads(grad_out, x_hat, weight, needs):
    """(input, weight, bias) gradients of linear on (..., tokens, features), the weight gradient
    taken on ``x_hat`` (None when not needed); ``needs`` says which to compute."""
    flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
    gx = grad_out @ weight if needs[0] else None
    gw = flat_grad.t() @ x_hat.reshape(-1, x_hat.shape[-1]) if needs[1] else None
    gb = flat_grad.sum(0) if needs[2] else None
    return gx, gw, gb


class PooledLinearFunction(torch.autograd.Function):
    """linear whose input (..., tokens, features) is saved as means over groups of k tokens."""

    @staticmethod
    def forward(ctx, x, weight, bias, k, storage):
        out = F.linear(x, weight, bias)
        packed = pack_tensor(pool_tokens(x.detach(), k), storage) if ctx.needs_input_grad[1] else ()
        ctx.save_for_backward(weight, *packed)
        ctx.k, ctx.storage, ctx.x_meta = k, storage, (tuple(x.shape), x.dtype)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, *packed = ctx.saved_tensors
        shape, dtype = ctx.x_meta
        x_hat = expand_tokens(unpack_tensor(packed, ctx.storage, dtype), ctx.k, shape[-2]) if packed else None
        needs = (ctx.needs_input_grad[0], bool(packed), ctx.has_bias and ctx.needs_input_grad[2])
        return (*linear_grads(grad_out, x_hat, weight, needs), None, None)


# ---------------------------------------------------------------------------------------------
# Exact companions: activations and max-pooling that keep bits or small indices, not tensors
# ---------------------------------------------------------------------------------------------

# 8 flags (bytes 0/1) in one int64 word -> one byte: multiplying by this constant moves byte i's
# bit to bit 56 + i with no carries (each product term lands on its own bit), then >> 56.
_GATHER = 0x0102040810204080
_SPREAD = 0x0101010101010101  # one byte -> the same byte in all 8 lanes
_SELECT = 0x8040201008040201 - 2**64  # lane i keeps bit i (as a signed int64 constant)


def pack_bits(mask: Tensor) -> Tensor:
    """Bool tensor -> uint8 tensor with 8 flags per byte (1 bit per element, element i of each
    group of 8 in bit i)."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.uint8).view(torch.int64)
    return ((words * _GATHER) >> 56).to(torch.uint8)


def unpack_bits(packed: Tensor, shape: torch.Size) -> Tensor:
    words = (packed.to(torch.int64) * _SPREAD) & torch.tensor(_SELECT, device=packed.device)
    return words.view(torch.uint8).view(-1)[: shape.numel()].view(shape).bool()


class MaskedActivationFunction(torch.autograd.Function):
    """Piecewise-linear activation (ReLU, ReLU6, Hardtanh) that saves a 1-bit pass mask.

    The mask is derived from the output, which is what stock autograd uses too, so gradients are
    bit-identical to stock.
    """

    @staticmethod
    def forward(ctx, x, lo, hi, inplace):
        if inplace:
            ctx.mark_dirty(x)
            y = torch.clamp_(x, lo, hi) if hi is not None else torch.relu_(x)
        else:
            y = torch.clamp(x, lo, hi) if hi is not None else torch.relu(x)
        passed = (y > lo) if hi is None else (y > lo) & (y < hi)
        ctx.save_for_backward(pack_bits(passed))
        ctx.shape = y.shape
        return y

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        return torch.where(unpack_bits(packed, ctx.shape), grad, 0.0), None, None, None


class CompactMaxPool2dFunction(torch.autograd.Function):
    """max_pool2d that saves the argmax position inside each window as uint8 (not the input and
    int64 plane indices, as stock does). The gradient is scattered exactly like stock."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        out, idx = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        h, w = x.shape[-2:]
        row0, col0 = _window_origins(out.shape[-2:], stride, padding, x.device)
        flat = idx.to(torch.int32)  # int32 arithmetic: half the memory traffic of int64
        r = flat // w
        col_off, row_off = flat.sub_(r * w).sub_(col0), r.sub_(row0)  # argmax offset in its window
        if dilation != (1, 1):
            col_off, row_off = col_off // dilation[1], row_off // dilation[0]
        local = row_off.mul_(kernel[1]).add_(col_off)
        ctx.save_for_backward(local.to(torch.uint8))
        ctx.geometry = (kernel, stride, padding, dilation, (h, w), tuple(x.shape))
        return out

    @staticmethod
    def backward(ctx, grad):
        (local,) = ctx.saved_tensors
        kernel, stride, padding, dilation, (h, w), shape = ctx.geometry
        row0, col0 = _window_origins(grad.shape[-2:], stride, padding, grad.device)
        # plane index = window origin + offset of the argmax inside the window (a small table)
        i = torch.arange(kernel[0], device=grad.device)[:, None] * dilation[0]
        j = torch.arange(kernel[1], device=grad.device)[None, :] * dilation[1]
        offsets = (i * w + j).flatten()
        idx = (offsets[local.long()] + (row0 * w + col0)).flatten(-2)
        gx = grad.new_zeros(*shape[:-2], h * w)
        gx.scatter_add_(-1, idx, grad.flatten(-2))
        return gx.view(shape), None, None, None, None, None


def _window_origins(out_hw, stride: Pair, padding: Pair, device) -> tuple[Tensor, Tensor]:
    rows = torch.arange(out_hw[0], device=device) * stride[0] - padding[0]
    cols = torch.arange(out_hw[1], device=device) * stride[1] - padding[1]
    return rows[:, None], cols[None, :]


# ---------------------------------------------------------------------------------------------
# BatchNorm with a lower-precision copy of its input (approximate, opt-in)
# ---------------------------------------------------------------------------------------------


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
        ctx.eps, ctx.storage, ctx.dtype = eps, storage, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, mean, invstd, *packed = ctx.saved_tensors
        x = unpack_tensor(packed, ctx.storage, ctx.dtype)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad.contiguous(), x, weight, None, None, mean, invstd, True, ctx.eps, mask
        )
        return gx, gw, gb, None, None, None, None, None
