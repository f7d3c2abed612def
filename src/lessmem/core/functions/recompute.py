"""A pure function of a few tensors that keeps only those tensors for backward: backward reruns it
under autograd, so output and gradients are bit for bit those of calling it directly, for the
memory of its inputs instead of its intermediates (a multi-op activation formula saves several
full-size tensors per call)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class RecomputedFunction(torch.autograd.Function):
    """``fn(*inputs)`` saving ``inputs`` only. ``fn`` must be deterministic (no dropout, no RNG)
    and must not modify its inputs."""

    @staticmethod
    def forward(ctx, fn: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
        device = inputs[0].device.type
        ctx.fn = fn
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        wanted = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(w) for t, w in zip(ctx.saved_tensors, wanted, strict=True)]
        device, enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = ctx.fn(*inputs)
        grads = iter(torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad))
        return None, *(next(grads) if t.requires_grad else None for t in inputs)
