"""Per-layer compression maps: ordered ``{module-name pattern: kernel}``, first match wins."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lessmem.core.modules import COMPRESSIBLE, LayerSpec
from lessmem.core.patterns import first_match, unmatched
from lessmem.core.storage import check_storage


def compressible_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Layers a map can address (stock or already compressed Conv2d / Linear), by name."""
    kinds = tuple(COMPRESSIBLE) + tuple(COMPRESSIBLE.values())
    return {
        name: m
        for name, m in model.named_modules()
        if type(m) in kinds
    }


def parse_spec(pattern: str, value: Any) -> LayerSpec:
    """``2`` | ``[2, 4]`` | ``{"kernel": 2, "storage": "bf16"}`` -> LayerSpec, or a clear error."""
    storage = "native"
    if isinstance(value, Mapping):
        unknown = set(value) - {"kernel", "storage"}
        if unknown or "kernel" not in value:
            raise ValueError(
                f"compression pattern {pattern!r}: a mapping value needs 'kernel' (and optionally "
                f"'storage'), got keys {sorted(value)}"
            )
        storage = check_storage(str(value.get("storage", "native")))
        value = value["kernel"]
    if isinstance(value, (list, tuple)) or _is_sequence_config(value):
        items = list(value)
        if len(items) != 2:
            raise ValueError(f"compression pattern {pattern!r}: kernel {items} must be k or [kh, kw]")
    else:
        items = [value, value]
    for k in items:
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(
                f"compression pattern {pattern!r}: kernel size {k!r} is not an integer "
                "(use e.g. 1 for exact, 2 or 4 for pooling)"
            )
        if k < 1:
            raise ValueError(f"compression pattern {pattern!r}: kernel size {k} must be >= 1")
    return LayerSpec((items[0], items[1]), storage)


def _is_sequence_config(value: Any) -> bool:
    # omegaconf.ListConfig without importing omegaconf: the core stays torch-only.
    return type(value).__name__ == "ListConfig"


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
