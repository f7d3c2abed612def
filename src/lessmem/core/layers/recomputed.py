"""Exact companions for timm / HF modules whose forward is a pure formula of several ops (matched
by class name in ``zoo_classes``): they keep the formula's inputs and recompute it in backward,
bit for bit, instead of keeping each op's intermediate."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lessmem.core.functions.recompute import (
    RecomputedFunction,
    SlicedAttentionFunction,
    SlicedGatedMLPFunction,
    SlicedRecomputedFunction,
)
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


class RecomputedRMSNorm(nn.Module):
    """HF Llama's RMSNorm where saved tensors are lossy (``saved_storage``): keeps its input only
    (stock keeps the normalised input as well), packed a slice of rows at a time, and reruns its
    formula on each decoded slice in backward. With native saved tensors the stock forward runs
    (a rerun sums the input's gradient terms in another order: not bit for bit)."""

    weight: nn.Parameter
    variance_epsilon: float

    def _normed(self, x: Tensor, weight: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return weight * h.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        storage = self.__dict__.get(RULE_ATTR, ("native",))[0]
        if storage == "native" or not needs_saving(x, self) or torch.compiler.is_compiling():
            return self.__dict__[ORIGINAL_CLASS_ATTR].forward(self, x)
        return SlicedRecomputedFunction.apply(self._normed, storage, x, self.weight)


class SlicedSDPAttention(nn.Module):
    """An HF attention module (Llama's) whose saved tensors are lossy (``saved_storage``): its own
    forward runs, with its ``F.scaled_dot_product_attention`` call (no mask, no dropout) taken by
    ``SlicedAttentionFunction``, which keeps q, k, v packed and no output, and decodes them a
    batch slice at a time in backward. With native saved tensors the stock call runs."""

    def forward(self, *args, **kwargs):
        stock = partial(self.__dict__[ORIGINAL_CLASS_ATTR].forward, self)
        storage = self.__dict__.get(RULE_ATTR, ("native",))[0]
        if storage == "native" or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return stock(*args, **kwargs)
        with _SlicedAttention(storage):
            return stock(*args, **kwargs)


class _SlicedAttention(TorchFunctionMode):
    """Routes the supported ``F.scaled_dot_product_attention`` calls to ``SlicedAttentionFunction``."""

    def __init__(self, storage: str) -> None:
        super().__init__()
        self.storage = storage

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = (*args, *(kwargs.get(n) for n in ("query", "key", "value")))[:3]
            options = {n: kwargs.get(n, default) for n, default in
                       (("attn_mask", None), ("dropout_p", 0.0), ("enable_gqa", False))}
            if (len(args) == 3 and options == {"attn_mask": None, "dropout_p": 0.0, "enable_gqa": False}
                    and set(kwargs) <= {"attn_mask", "dropout_p", "enable_gqa", "is_causal", "scale"}
                    and q.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0]
                    and any(t.requires_grad for t in (q, k, v))):
                return SlicedAttentionFunction.apply(q, k, v, bool(kwargs.get("is_causal", False)),
                                                     kwargs.get("scale"), self.storage)
        return func(*args, **kwargs)
