"""A pure function of a few tensors that keeps only those tensors for backward: backward reruns it
under autograd, so output and gradients are bit for bit those of calling it directly, for the
memory of its inputs instead of its intermediates (a multi-op activation formula saves several
full-size tensors per call).

Its layers are exact companions for timm / HF modules whose forward is such a formula (matched by
class name in the ``registry``): they keep the formula's inputs and recompute it in backward, bit
for bit, instead of keeping each op's intermediate."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from lessmem.core.ops.dispatch import ORIGINAL_CLASS_ATTR, needs_saving


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


def _recomputed(fn: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs) or torch.compiler.is_compiling():
        return fn(*inputs)  # nothing saved, or the compiler chooses what to keep
    return RecomputedFunction.apply(fn, *inputs)


class RecomputedActivation(nn.Module):
    """An elementwise activation written as several ops (HF's NewGELU: pow, tanh, muls) keeping
    only its input: its own class's forward reruns in backward."""

    def forward(self, x: Tensor) -> Tensor:
        stock = partial(self.__dict__[ORIGINAL_CLASS_ATTR].forward, self)
        if not needs_saving(x, self):
            return stock(x)
        return _recomputed(stock, x)


class RecomputedGatedMLP(nn.Module):
    """HF Llama's MLP, ``down(act(gate(x)) * up(x))``, whose product keeps ``gate(x)`` and
    ``up(x)`` only (stock keeps ``act(gate(x))`` as well, and the activation its input)."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module

    def _gated(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.act_fn(gate) * up

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(_recomputed(self._gated, self.gate_proj(x), self.up_proj(x)))
