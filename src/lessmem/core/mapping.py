"""Per-layer compression maps: ordered ``{module-name pattern: kernel}``, first match wins.

Module-name patterns (fnmatch, case-sensitive) and "first matching pattern wins" are the one rule
every map in lessmem follows (``first_match``)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from lessmem.core.ops.registry import COMPRESSED_CLASSES, compressed_class_of
from lessmem.core.spec import LayerSpec, parse_spec


def first_match(name: str, patterns: Iterable[str]) -> str | None:
    """The first of ``patterns`` that matches ``name``, or None."""
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def unmatched(patterns: Iterable[str], names: Iterable[str]) -> list[str]:
    """The patterns that match none of ``names`` (a typo in a map is an error, not a no-op)."""
    names = list(names)
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]


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
