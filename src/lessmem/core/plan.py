"""A complete compression choice as one value: the map and the settings it runs with, so that a
chooser (``lessmem.fit``) hands back something ``compress(model, choice)`` applies as it is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompressionPlan:
    map: dict[str, Any] = field(default_factory=dict)  # pattern -> kernel / spec text, as compress reads it
    norm_storage: str | Mapping[str, str] = "native"
    act_storage: str | Mapping[str, str] = "native"
    exact_companions: bool = True
