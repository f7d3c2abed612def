"""Layers grouped by pattern into the units a greedy map or a search assigns one kernel to."""

from __future__ import annotations

from collections.abc import Sequence

from lessmem.core import first_match


def group_layers(layers: Sequence[str], groups: Sequence[str] | None) -> dict[str, list[str]]:
    """Units of a search/greedy: ``{pattern: layers}`` (first matching pattern wins); a layer
    matched by no pattern is its own unit, keyed by its name."""
    units: dict[str, list[str]] = {}
    for name in layers:
        key = first_match(name, groups or ()) or name
        units.setdefault(key, []).append(name)
    unused = [p for p in groups or () if p not in units]
    if unused:
        raise ValueError(f"group pattern(s) {unused} match no conv layer; layers: {list(layers)}")
    return units
