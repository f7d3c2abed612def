"""Compressed conv / linear as ``torch.library`` custom ops, used when ``torch.compile`` traces
the model. A custom op is opaque to the compiler, so what it saves for backward is exactly the
pooled tensor, as in eager mode; the fake kernels give the compiler output shapes without data."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops import expand_blocks, expand_tokens, pool_blocks, pool_tokens


def _conv_and_pool(x, weight, bias, stride, padding, dilation, groups, kernel, bf16):
    out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    pooled = pool_blocks(x, tuple(kernel))
    return out, pooled.to(torch.bfloat16) if bf16 else pooled


@torch.library.custom_op("lessmem::pooled_conv2d", mutates_args=())
def pooled_conv2d(
    x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
    dilation: list[int], groups: int, kernel: list[int], bf16: bool,
) -> tuple[Tensor, Tensor]:
    """conv2d output, and the k×k block means of its input (what backward keeps)."""
    out, pooled = _conv_and_pool(x, weight, bias, stride, padding, dilation, groups, kernel, bf16)
    return out, pooled


@pooled_conv2d.register_fake
def _(x, weight, bias, stride, padding, dilation, groups, kernel, bf16):
    return _conv_and_pool(x, weight, bias, stride, padding, dilation, groups, kernel, bf16)


def _conv_setup(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, groups, kernel, _ = inputs
    ctx.save_for_backward(weight, output[1])
    ctx.conf = (stride, padding, dilation, groups, kernel, x.shape, x.dtype, bias is not None)


def _conv_backward(ctx, grad_out, _grad_pooled):
    weight, pooled = ctx.saved_tensors
    stride, padding, dilation, groups, kernel, shape, dtype, has_bias = ctx.conf
    x_hat = expand_blocks(pooled.to(dtype), tuple(kernel), tuple(shape[2:]))
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2]]
    gx, gw, gb = torch.ops.aten.convolution_backward(
        grad_out, x_hat, weight, [weight.shape[0]] if has_bias else None,
        stride, padding, dilation, False, [0, 0], groups, mask,
    )
    return gx, gw, gb, None, None, None, None, None, None


pooled_conv2d.register_autograd(_conv_backward, setup_context=_conv_setup)


def _linear_and_pool(x, weight, bias, k, bf16):
    pooled = pool_tokens(x, k)
    return F.linear(x, weight, bias), pooled.to(torch.bfloat16) if bf16 else pooled


@torch.library.custom_op("lessmem::pooled_linear", mutates_args=())
def pooled_linear(x: Tensor, weight: Tensor, bias: Tensor | None, k: int, bf16: bool) -> tuple[Tensor, Tensor]:
    """linear output, and the means over groups of k tokens of its input."""
    out, pooled = _linear_and_pool(x, weight, bias, k, bf16)
    return out, pooled.contiguous()


@pooled_linear.register_fake
def _(x, weight, bias, k, bf16):
    out, pooled = _linear_and_pool(x, weight, bias, k, bf16)
    return out, pooled.contiguous()


def _linear_setup(ctx, inputs, output):
    x, weight, bias, k, _ = inputs
    ctx.save_for_backward(weight, output[1])
    ctx.conf = (k, x.shape, x.dtype, bias is not None)


def _linear_backward(ctx, grad_out, _grad_pooled):
    weight, pooled = ctx.saved_tensors
    k, shape, dtype, has_bias = ctx.conf
    gx = grad_out @ weight if ctx.needs_input_grad[0] else None
    x_hat = expand_tokens(pooled.to(dtype), k, shape[-2])
    flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
    gw = flat_grad.t() @ x_hat.reshape(-1, shape[-1]) if ctx.needs_input_grad[1] else None
    gb = flat_grad.sum(0) if has_bias and ctx.needs_input_grad[2] else None
    return gx, gw, gb, None, None


pooled_linear.register_autograd(_linear_backward, setup_context=_linear_setup)
