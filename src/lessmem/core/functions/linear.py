"""linear on (..., tokens, features) that saves its input only as means over groups of k tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lessmem.core.functions.pooled_input import save_pooled_input, saved_pooled_input
from lessmem.core.functions.pooling import expand_tokens, pooled_tokens_once


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
        packed = pooled_tokens_once(x, k, storage) if ctx.needs_input_grad[1] else None
        save_pooled_input(ctx, x, weight, bias, packed, storage)
        ctx.k = k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, pooled, shape, needs = saved_pooled_input(ctx)
        x_hat = expand_tokens(pooled, ctx.k, shape[-2]) if pooled is not None else None
        return (*linear_grads(grad_out, x_hat, weight, needs), None, None)
