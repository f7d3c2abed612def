"""Per-layer compression maps: ordered ``{module-name pattern: kernel}``, first match wins."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lessmem.core.layers.registry import COMPRESSED_CLASSES, compressed_class_of
from lessmem.core.patterns import first_match, unmatched
from lessmem.core.spec import LayerSpec, parse_spec


def compressible_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Layers a map can address (Conv2d / Linear / attention, and timm / HF linears whose math is
    known; stock or already compressed), by name."""
    return {
        name: m
        for name, m in model.named_modules()
        if type(m) in COMPRESSED_CLASSES or compressed_class_of(m) is not None
    }


def resolve_mapping(model: nn.Module, mapping: Mapping[str, Any] | None) -> dict[str, LayerSpec]:
    """Assign a spec to each compressible layer. Every pattern must match at least one layer."""
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping) and type(mapping).__name__ != "DictConfig":
        raise TypeError(f"compression map must be a mapping of pattern -> kernel, got {type(mapping).__name__}")
    layers = list(compressible_layers(model))
    specs = {str(p): parse_spec(str(p), v) for p, v in mapping.items()}
    assigned: dict[str, LayerSpec] = {}
    for name in layers:
        pattern = first_match(name, specs)
        if pattern is not None:
            assigned[name] = specs[pattern]
    unused = unmatched(specs, layers)
    if unused:
        raise ValueError(
            f"compression pattern(s) {unused} match no compressible layer of "
            f"{type(model).__name__}. Available layers: {_abbreviate(layers)}"
        )
    return assigned


def _abbreviate(names: list[str], limit: int = 60) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
