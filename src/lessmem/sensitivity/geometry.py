"""The layers a sensitivity measurement covers: Conv2d layers, with the geometry
``convolution_backward`` needs to recompute their weight gradients, and linears on token inputs
(transformers), whose weight gradient is a plain product."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core import pools_tokens

log = logging.getLogger(__name__)


@dataclass
class ConvLayer:
    name: str
    module: nn.Conv2d
    stride: tuple[int, ...]
    padding: tuple[int, int]
    pre_pad: Callable[[Tensor], Tensor] | None
    extra: tuple[int, int] = (0, 0)  # rows/cols pre_pad adds: the saved tensor is the padded one


def _conv_geometry(name: str, m: nn.Conv2d) -> ConvLayer | None:
    """Integer padding for convolution_backward; None (skipped) for asymmetric 'same'."""
    if m.padding_mode != "zeros":
        pads, mode = m._reversed_padding_repeated_twice, m.padding_mode
        extra = (pads[2] + pads[3], pads[0] + pads[1])
        return ConvLayer(name, m, m.stride, (0, 0), lambda x: F.pad(x, pads, mode=mode), extra)
    if isinstance(m.padding, str):
        if m.padding == "valid":
            return ConvLayer(name, m, m.stride, (0, 0), None)
        total = [d * (k - 1) for k, d in zip(m.kernel_size, m.dilation, strict=True)]
        if any(t % 2 for t in total):
            log.warning("sensitivity: skipping %s (asymmetric padding='same')", name)
            return None
        return ConvLayer(name, m, m.stride, (total[0] // 2, total[1] // 2), None)
    return ConvLayer(name, m, m.stride, tuple(m.padding), None)


@dataclass
class TokenLinearLayer:
    """A linear the core pools over groups of k tokens (nn.Linear, HF Conv1D); measured when it
    reads (..., tokens, features) inputs (a classifier head on (batch, features) is not pooled)."""

    name: str
    module: nn.Module


SensitivityLayer = ConvLayer | TokenLinearLayer


def conv_layers(model: nn.Module) -> list[ConvLayer]:
    """Every Conv2d (stock or compressed subclass) whose weight trains."""
    return [layer for layer in sensitivity_layers(model) if isinstance(layer, ConvLayer)]


def sensitivity_layers(model: nn.Module) -> list[SensitivityLayer]:
    """Every Conv2d and token-pooling linear (stock or compressed) whose weight trains, in module order."""
    found: list[SensitivityLayer | None] = []
    for name, m in model.named_modules():
        weight = getattr(m, "weight", None)
        if not isinstance(weight, nn.Parameter) or not weight.requires_grad:
            continue
        if isinstance(m, nn.Conv2d):
            found.append(_conv_geometry(name, m))
        elif pools_tokens(m):
            found.append(TokenLinearLayer(name, m))
    return [f for f in found if f is not None]
