"""A layer's weight gradient recomputed from its input as the core keeps it (pooled, stored).

Compression only changes what a conv keeps for its *weight* gradient; the input gradient uses the
weight alone and stays exact. So with exact companions and native norm storage every layer's
output gradient is the same whatever option any layer uses, and for each Conv2d the compressed
weight gradient for kernel k is exactly

    convolution_backward(grad_out, expand_blocks(pool_blocks(x, k), k), weight, ...)[1]

with ``x`` the layer's input and ``grad_out`` its output gradient from the stock pass; for a linear
on tokens it is ``grad_out^T expand_tokens(pool_tokens(x, k), k)`` summed over batch and tokens
(transposed for HF Conv1D's (in, out) weight, which changes neither cosine nor relative error).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lessmem.core import (
    expand_blocks,
    expand_tokens,
    pack_tensor,
    pool_blocks,
    pool_tokens,
    tensor_meta,
    unpack_tensor,
)
from lessmem.sensitivity.geometry import ConvLayer, SensitivityLayer, TokenLinearLayer


def conv_weight_grad(layer: ConvLayer, grad_out: Tensor, x: Tensor) -> Tensor:
    m = layer.module
    return torch.ops.aten.convolution_backward(
        grad_out, x, m.weight.detach(), None, layer.stride, layer.padding, m.dilation,
        False, [0, 0], m.groups, [False, True, False],
    )[1]


def linear_weight_grad(grad_out: Tensor, x: Tensor) -> Tensor:
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
        return linear_weight_grad(grad_out, expand_tokens(pooled, k, x.shape[-2]))
    return conv_weight_grad(layer, grad_out, expand_blocks(pooled, (k, k), x.shape[-2:]))


def pooled_numel(shape: Sequence[int], k: int, tokens: bool) -> int:
    """Elements of an input of ``shape`` pooled by ``k``: over tokens (dim -2) of a
    (..., tokens, features) input, or k x k blocks of an (n, c, h, w) one."""
    if tokens:
        return math.prod(shape[:-2]) * math.ceil(shape[-2] / k) * shape[-1]
    n, c, h, w = shape
    return n * c * math.ceil(h / k) * math.ceil(w / k)
