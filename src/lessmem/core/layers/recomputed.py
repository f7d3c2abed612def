"""Exact companions for timm / HF modules whose forward is a pure formula of several ops (matched
by class name in ``zoo_classes``): they keep the formula's inputs and recompute it in backward,
bit for bit, instead of keeping each op's intermediate."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from lessmem.core.functions.recompute import RecomputedFunction, SlicedGatedMLPFunction
from lessmem.core.layers.dispatch import ORIGINAL_CLASS_ATTR, needs_saving
from lessmem.core.layers.linear import CompressedLinear, keeps_stock_path
from lessmem.core.saved_storage import HOOK_IDS_ATTR, RULE_ATTR


def _recomputed(fn: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs) or torch.compiler.is_compiling():
        return fn(*inputs)  # nothing saved, or the compiler chooses what to keep
    return RecomputedFunction.apply(fn, *inputs)


def _global_module_hooks() -> bool:
    module = nn.modules.module
    return bool(module._global_forward_pre_hooks or module._global_forward_hooks)


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
        if self._sliceable(x):
            storages = (self.gate_proj.lessmem_spec.storage, self.__dict__.get(RULE_ATTR, ("native",))[0],
                        self.down_proj.lessmem_spec.storage)
            return SlicedGatedMLPFunction.apply(
                self._gated, x, self.gate_proj.weight, self.gate_proj.bias, self.up_proj.weight,
                self.up_proj.bias, self.down_proj.weight, self.down_proj.bias, storages)
        return self.down_proj(_recomputed(self._gated, self.gate_proj(x), self.up_proj(x)))

    def _sliceable(self, x: Tensor) -> bool:
        """Whether the whole MLP may run as one ``SlicedGatedMLPFunction`` (backward in token
        slices): three token linears without token pooling, gate and up keeping x alike, in
        eager mode without autocast, and no hooks on the projections but saved_storage's (the
        projections' own forwards do not run)."""
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        if not all(isinstance(p, CompressedLinear) and p.lessmem_spec.kernel[0] == 1 for p in projections):
            return False
        if self.gate_proj.lessmem_spec.storage != self.up_proj.lessmem_spec.storage:
            return False
        if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type) or keeps_stock_path(self.gate_proj, x):
            return False
        return all(set(p._forward_pre_hooks) | set(p._forward_hooks) <= set(p.__dict__.get(HOOK_IDS_ATTR, ()))
                   for p in projections) and not _global_module_hooks()
