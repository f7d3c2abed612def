"""Saved bytes per block of a model, stock vs compressed: builds the model and measures it."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from lessmem.core import compress, measure_memory
from lessmem.models import build_model


def block_of(layer: str) -> str:
    """``layer1.0.conv1`` -> ``layer1.0``; ``features.3.conv.0`` -> ``features.3``; ``bn1`` -> ``stem``
    (top-level modules before the first stage); ``''`` (functional ops) -> ``(functional)``."""
    if not layer:
        return "(functional)"
    parts = layer.split(".")
    if len(parts) >= 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    if parts[0] in ("conv1", "bn1", "relu", "maxpool"):
        return "stem"
    return parts[0]


def per_layer_memory(model_name: str, mapping: Mapping[str, Any], *, batch: int = 32, size: int = 224,
                     num_classes: int = 1000, compress_kwargs: Mapping[str, Any] | None = None,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Stock vs compressed saved bytes per block (``block_of``) of ``model_name``, with
    ``lessmem.core.measure_memory(...).per_layer``. Rows keep the model's block order."""
    torch.manual_seed(seed)
    model = build_model(model_name, num_classes=num_classes).train()
    x = torch.randn(batch, 3, size, size)
    stock = measure_memory(model, x).per_layer
    comp_model = compress(copy.deepcopy(model), dict(mapping), **dict(compress_kwargs or {}))
    comp = measure_memory(comp_model, x).per_layer
    order: OrderedDict[str, None] = OrderedDict()
    for name, _ in model.named_modules():
        if name:
            order[block_of(name)] = None
    sums: dict[str, list[int]] = {}
    for i, per in enumerate((stock, comp)):
        for layer, b in per.items():
            sums.setdefault(block_of(layer), [0, 0])[i] += b
    keys = [k for k in order if k in sums] + [k for k in sums if k not in order]
    return [{"block": k, "stock_bytes": sums[k][0], "compressed_bytes": sums[k][1]} for k in keys]
