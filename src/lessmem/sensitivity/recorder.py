"""Hooks that turn one stock backward into every kernel's weight-gradient fidelity.

Compression only changes what a conv keeps for its *weight* gradient; the input gradient uses the
weight alone and stays exact. So with exact companions and native norm storage every layer's
output gradient is the same whatever kernel any layer uses, and for each Conv2d the compressed
weight gradient for kernel k is exactly

    convolution_backward(grad_out, expand_blocks(pool_blocks(x, k), k), weight, ...)[1]

with ``x`` the layer's input and ``grad_out`` its output gradient from the stock pass; for a linear
on tokens it is ``grad_out^T expand_tokens(pool_tokens(x, k), k)`` summed over batch and tokens
(transposed for HF Conv1D's (in, out) weight, which changes neither cosine nor relative error).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lessmem.core import (
    expand_blocks,
    expand_tokens,
    kept_by_graph,
    pack_tensor,
    pool_blocks,
    pool_tokens,
    tensor_meta,
    unpack_tensor,
)
from lessmem.sensitivity.geometry import ConvLayer, SensitivityLayer, TokenLinearLayer


def _weight_grad(layer: ConvLayer, grad_out: Tensor, x: Tensor) -> Tensor:
    m = layer.module
    return torch.ops.aten.convolution_backward(
        grad_out, x, m.weight.detach(), None, layer.stride, layer.padding, m.dilation,
        False, [0, 0], m.groups, [False, True, False],
    )[1]


def _linear_weight_grad(grad_out: Tensor, x: Tensor) -> Tensor:
    """(out, in) weight gradient of a linear from its (..., tokens, features) input and output gradient."""
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def pooled_weight_grad(layer: SensitivityLayer, grad_out: Tensor, x: Tensor, k: int,
                       storage: str = "native") -> Tensor:
    """The layer's weight gradient taken from its input ``x`` as the core keeps it: pooled by ``k``
    (k x k blocks, or groups of k tokens) in ``storage``, then expanded back."""
    tokens = isinstance(layer, TokenLinearLayer)
    pooled = pool_tokens(x, k) if tokens else pool_blocks(x, (k, k))
    if storage != "native":
        pooled = unpack_tensor(pack_tensor(pooled, storage), storage, tensor_meta(pooled))
    if tokens:
        return _linear_weight_grad(grad_out, expand_tokens(pooled, k, x.shape[-2]))
    return _weight_grad(layer, grad_out, expand_blocks(pooled, (k, k), x.shape[-2:]))


def pooled_numel(shape: Sequence[int], k: int, tokens: bool) -> int:
    """Elements of an input of ``shape`` pooled by ``k``: over tokens (dim -2) of a
    (..., tokens, features) input, or k x k blocks of an (n, c, h, w) one."""
    if tokens:
        return math.prod(shape[:-2]) * math.ceil(shape[-2] / k) * shape[-1]
    n, c, h, w = shape
    return n * c * math.ceil(h / k) * math.ceil(w / k)


def _fidelity(exact: Tensor, approx: Tensor) -> tuple[float, float]:
    """(cosine, relative L2 error) in float64; an all-zero exact gradient counts as perfect."""
    e, a = exact.double().flatten(), approx.double().flatten()
    norm = e.norm()
    if norm == 0:
        return (1.0, 0.0) if a.norm() == 0 else (0.0, math.inf)
    cos = float(torch.dot(e, a) / (norm * a.norm()).clamp_min(1e-300))
    return cos, float((a - e).norm() / norm)


class GradientRecorder:
    """Forward hooks keep each layer's input; a tensor hook on the output computes all kernels'
    weight gradients as soon as the output gradient arrives, then drops the input."""

    def __init__(self, layers: list[SensitivityLayer], kernels: Sequence[int]) -> None:
        self.layers, self.kernels = layers, list(kernels)
        self.stats: dict[str, list[tuple[float, float]]] = {}  # "layer/k" -> [(cos, rel)]
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.elem: dict[str, int] = {}
        self.groups: dict[str, tuple[int, tuple[int, ...], str]] = {}
        self._inputs: dict[str, tuple[Tensor, int]] = {}
        # Layers reading a tensor no op produced (the model's input batch): the caller holds it
        # anyway, so stock keeps 0 extra bytes for it and a pooled copy only adds (core.memory).
        self.caller_held: set[str] = set()
        # Linears reading a tensor autograd keeps anyway (attention's output into its projection):
        # the core holds a reference there whatever the kernel, so every kernel is exact and free.
        self.graph_kept: set[str] = set()

    def forward_hook(self, layer: SensitivityLayer) -> Callable[..., None]:
        tokens = isinstance(layer, TokenLinearLayer)

        def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            x = args[0]
            if not torch.is_grad_enabled() or not out.requires_grad or (tokens and x.dim() < 3):
                return  # no token dim: the core keeps the input whole, so there is nothing to choose
            if x.grad_fn is None and not x.requires_grad and (tokens or layer.pre_pad is None):
                self.caller_held.add(layer.name)
            if tokens and kept_by_graph(x):
                self.graph_kept.add(layer.name)
            x = x.detach()
            if tokens:
                self.shapes[layer.name] = (x[..., 0, 0].numel(), x.shape[-2], x.shape[-1])
            else:
                n, c, h, w = x.shape
                self.shapes[layer.name] = (n, c, h + layer.extra[0], w + layer.extra[1])
            self.elem[layer.name] = x.element_size()
            # Same storage and shape: one tensor read by several convs (stored once by the core).
            # A pre-padded input is a fresh tensor per conv, so it never shares.
            owner = layer.name if not tokens and layer.pre_pad is not None else ""
            self.groups[layer.name] = (x.untyped_storage().data_ptr(), tuple(x.shape), owner)
            self._inputs[layer.name] = (x, x._version)
            out.register_hook(lambda g: self._backward(layer, g))
        return hook

    def drop_inputs(self) -> None:
        """Forget inputs whose layer's output did not reach the loss (no backward came)."""
        self._inputs.clear()

    def _backward(self, layer: SensitivityLayer, grad_out: Tensor) -> None:
        x, version = self._inputs.pop(layer.name)
        if x._version != version:
            raise RuntimeError(f"input of {layer.name} was modified in place after the layer; "
                               "sensitivity needs it unchanged (use non-inplace ops before it)")
        if isinstance(layer, TokenLinearLayer):
            exact = _linear_weight_grad(grad_out, x)
            self._record(layer.name, exact, lambda k: exact if layer.name in self.graph_kept else pooled_weight_grad(
                layer, grad_out, x, k))
            return
        if layer.pre_pad is not None:
            x = layer.pre_pad(x)
        self._record(layer.name, _weight_grad(layer, grad_out, x), lambda k: pooled_weight_grad(layer, grad_out, x, k))

    def _record(self, name: str, exact: Tensor, pooled_grad: Callable[[int], Tensor]) -> None:
        for k in self.kernels:
            approx = exact if k == 1 else pooled_grad(k)
            self.stats.setdefault(f"{name}/{k}", []).append(_fidelity(exact, approx))

    def pooled_bytes(self, name: str, k: int) -> int:
        """Bytes the layer keeps for its weight gradient with kernel k (k=1: the stock input)."""
        if (k == 1 and name in self.caller_held) or name in self.graph_kept:
            return 0
        shape = self.shapes[name]  # (inputs, tokens, features) or (n, c, h, w)
        return pooled_numel(shape, k, tokens=len(shape) == 3) * self.elem[name]
