"""The compressed layers as ``torch.library`` custom ops, used when ``torch.compile`` traces the
model. Each conv / linear op takes the input *and* its pooled copy and keeps only the pooled copy
(and the weight) for backward; being opaque to the compiler, it cannot be made to keep the full
input. Pooling and the activation masks are custom ops too, running the same kernels as eager
mode: as plain aten ops the partitioner would recompute them in backward from the BatchNorm
inputs it keeps (less memory, but a recomputed BatchNorm + ReLU + pooling per layer, 1.3x the
compiled stock step). A pooled copy is still one graph value, so layers that read the same input
(ResNet's conv1 and downsample) share it, as in eager mode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lessmem.core.layout import format_of
from lessmem.core.ops.conv import pooled_conv_grads
from lessmem.core.ops.linear import linear_grads
from lessmem.core.ops.masked_activations import clamp_and_pack, masked_grad
from lessmem.core.ops.pooling import expand_tokens, pool_blocks
from lessmem.core.storage import BFLOAT16, pack_tensor


@torch.library.custom_op("lessmem::pool_blocks", mutates_args=())
def pool_blocks_op(x: Tensor, kernel: list[int], storage: str) -> Tensor:
    """k×k block means of ``x`` in its storage dtype (native or bf16)."""
    return pack_tensor(pool_blocks(x, tuple(kernel)), storage)[0].contiguous(memory_format=format_of(x))


@pool_blocks_op.register_fake
def _(x, kernel, storage):
    n, c, h, w = x.shape
    dtype = torch.bfloat16 if storage in BFLOAT16 else x.dtype
    return x.new_empty((n, c, -(-h // kernel[0]), -(-w // kernel[1])), dtype=dtype).contiguous(
        memory_format=format_of(x))


@torch.library.custom_op("lessmem::clamp_mask", mutates_args=())
def clamp_mask_op(x: Tensor, lo: float, hi: float | None) -> tuple[Tensor, Tensor]:
    """(clamp(x, lo, hi), its pass mask packed 8 flags per byte in memory order)."""
    return clamp_and_pack(x.contiguous(memory_format=format_of(x)), lo, hi)[:2]


@clamp_mask_op.register_fake
def _(x, lo, hi):
    return torch.empty_like(x, memory_format=format_of(x)), x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


def _mask_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


@torch.library.custom_op("lessmem::masked_grad", mutates_args=())
def masked_grad_op(grad: Tensor, bits: Tensor, channels_last: bool) -> Tensor:
    """``grad`` where the packed pass bit is set, else 0 (in the activation's layout)."""
    return masked_grad(grad.contiguous(memory_format=_mask_format(channels_last)), bits, channels_last)


@masked_grad_op.register_fake
def _(grad, bits, channels_last):
    return torch.empty_like(grad, memory_format=_mask_format(channels_last))


def _clamp_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.channels_last = format_of(output[0]) == torch.channels_last


def _clamp_backward(ctx, grad_y, grad_bits):
    (bits,) = ctx.saved_tensors
    return torch.ops.lessmem.masked_grad(grad_y, bits, ctx.channels_last), None, None


clamp_mask_op.register_autograd(_clamp_backward, setup_context=_clamp_setup)


@torch.library.custom_op("lessmem::conv2d_keep_pooled", mutates_args=())
def conv2d_keep_pooled(
    x: Tensor, pooled: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
    padding: list[int], dilation: list[int], groups: int, kernel: list[int],
) -> Tensor:
    """conv2d whose backward keeps ``pooled`` (the k×k block means of ``x``), not ``x``."""
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups)


@conv2d_keep_pooled.register_fake
def _(x, pooled, weight, bias, stride, padding, dilation, groups, kernel):
    return F.conv2d(x, weight, bias, stride, padding, dilation, groups)


def _conv_setup(ctx, inputs, output):
    x, pooled, weight, bias, stride, padding, dilation, groups, kernel = inputs
    ctx.save_for_backward(weight, pooled)
    ctx.conf = (stride, padding, dilation, groups, kernel, x.shape, x.dtype, bias is not None)


def _conv_backward(ctx, grad_out):
    weight, pooled = ctx.saved_tensors
    stride, padding, dilation, groups, kernel, shape, dtype, has_bias = ctx.conf
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[2], has_bias and ctx.needs_input_grad[3])
    gx, gw, gb = pooled_conv_grads(grad_out, pooled.to(dtype), tuple(shape), weight, has_bias,
                                   tuple(stride), tuple(padding), tuple(dilation), groups,
                                   tuple(kernel), needs)
    return gx, None, gw, gb, None, None, None, None, None


conv2d_keep_pooled.register_autograd(_conv_backward, setup_context=_conv_setup)


@torch.library.custom_op("lessmem::linear_keep_pooled", mutates_args=())
def linear_keep_pooled(x: Tensor, pooled: Tensor, weight: Tensor, bias: Tensor | None, k: int) -> Tensor:
    """linear whose backward keeps ``pooled`` (means over groups of k tokens of ``x``)."""
    return F.linear(x, weight, bias)


@linear_keep_pooled.register_fake
def _(x, pooled, weight, bias, k):
    return F.linear(x, weight, bias)


def _linear_setup(ctx, inputs, output):
    x, pooled, weight, bias, k = inputs
    ctx.save_for_backward(weight, pooled)
    ctx.conf = (k, x.shape, x.dtype, bias is not None)


def _linear_backward(ctx, grad_out):
    weight, pooled = ctx.saved_tensors
    k, shape, dtype, has_bias = ctx.conf
    x_hat = expand_tokens(pooled.to(dtype), k, shape[-2]) if ctx.needs_input_grad[2] else None
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[2], has_bias and ctx.needs_input_grad[3])
    gx, gw, gb = linear_grads(grad_out, x_hat, weight, needs)
    return gx, None, gw, gb, None


linear_keep_pooled.register_autograd(_linear_backward, setup_context=_linear_setup)
