"""Compressed conv / linear as ``torch.library`` custom ops, used when ``torch.compile`` traces
the model. Each op takes the input *and* its pooled copy and keeps only the pooled copy (and the
weight) for backward; being opaque to the compiler, it cannot be made to keep the full input.
Pooling itself stays an ordinary aten op outside, so the compiler shares one pooled copy between
layers that read the same input (ResNet's conv1 and downsample), as eager mode does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops import expand_tokens, linear_grads, pooled_conv_grads


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
