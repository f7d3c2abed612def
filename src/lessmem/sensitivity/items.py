"""One place a map can compress (a menu item) and how its options are written."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Item kinds the compression map addresses (the others take norm_storage / act_storage / saved_storage).
MAP_KINDS = ("conv", "linear")

def option_name(kernel: int, storage: str) -> str:
    """How a conv option is written in a map: ``"2"``, ``"2/int4"``, ``"int4"`` (kernel 1)."""
    if storage == "native":
        return str(kernel)
    return storage if kernel == 1 else f"{kernel}/{storage}"


@dataclass
class MenuItem:
    name: str
    kind: str  # "conv" | "linear" (token-pooling linear) | "norm" | "act" | "saved" (a module's own saves)
    options: list[str]
    nbytes: list[int]  # per option
    criteria: dict[str, list[list[float]]]  # criterion -> per batch -> per option
    group: int | None = None  # conv items reading one tensor share a group id
    shielded: bool = False  # a "saved" item whose module has children (kept native by its rule)

    @property
    def exact_option(self) -> str:
        return "1" if self.kind in MAP_KINDS else "native"

    def mean(self, criterion: str) -> list[float]:
        return [float(v) for v in np.mean(np.asarray(self.criteria[criterion], dtype=float), axis=0)]

    def index(self, option: str) -> int:
        if option not in self.options:
            raise ValueError(f"{self.kind} {self.name!r}: option {option!r} was not measured; have {self.options}")
        return self.options.index(option)
