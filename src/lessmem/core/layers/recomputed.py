"""Exact companions for timm / HF modules whose forward is a pure formula of several ops (matched
by class name in ``zoo_classes``): they keep the formula's inputs and recompute it in backward,
bit for bit, instead of keeping each op's intermediate."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from lessmem.core.functions.recompute import RecomputedFunction
from lessmem.core.layers.dispatch import ORIGINAL_CLASS_ATTR, needs_saving


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
