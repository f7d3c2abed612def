"""One place a map can compress (a menu item) and how its options are written."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Item kinds the compression map addresses (the others take norm_storage / act_storage / saved_storage).
MAP_KINDS = ("conv", "linear")
# A conv that can rebuild its input from the BatchNorm before it (``"from_bn"``) and that BatchNorm,
# choosing together: the rebuilt input's error depends on the BatchNorm's storage. Its options are
# ``joint_option(BatchNorm storage, conv option)``; the map takes the conv part, norm_storage the other.
JOINT_KIND = "norm_conv"


def joint_option(norm: str, conv: str) -> str:
    """A norm_conv item's option: ``"int2|from_bn"``, ``"native|2/int4"``."""
    return f"{norm}|{conv}"


def split_joint(option: str) -> tuple[str, str]:
    """(BatchNorm storage, conv option) of a norm_conv item's option."""
    norm, _, conv = option.partition("|")
    return norm, conv

def option_name(kernel: int, storage: str) -> str:
    """How a conv option is written in a map: ``"2"``, ``"2/int4"``, ``"int4"`` (kernel 1)."""
    if storage == "native":
        return str(kernel)
    return storage if kernel == 1 else f"{kernel}/{storage}"


@dataclass
class MenuItem:
    name: str
    kind: str  # "conv" | "linear" (token-pooling linear) | "norm" | "act" | "saved" (a module's own saves) | "norm_conv"
    options: list[str]
    nbytes: list[int]  # per option
    criteria: dict[str, list[list[float]]]  # criterion -> per batch -> per option
    group: int | None = None  # conv items reading one tensor share a group id
    shielded: bool = False  # a "saved" item whose module has children (kept native by its rule)
    partner: str | None = None  # a norm_conv item (named by its conv): the BatchNorm it chooses with

    @property
    def exact_option(self) -> str:
        if self.kind == JOINT_KIND:
            return joint_option("native", "1")
        return "1" if self.kind in MAP_KINDS else "native"

    def mean(self, criterion: str) -> list[float]:
        return [float(v) for v in np.mean(np.asarray(self.criteria[criterion], dtype=float), axis=0)]

    def index(self, option: str) -> int:
        if option not in self.options:
            raise ValueError(f"{self.kind} {self.name!r}: option {option!r} was not measured; have {self.options}")
        return self.options.index(option)


def shared_options(members: Sequence[MenuItem]) -> list[str]:
    """The options every item of a unit (items reading one tensor) measured, in the first's order:
    what the unit can choose together."""
    return [o for o in members[0].options if all(o in m.options for m in members)]


@dataclass
class RecomputeOption:
    """A region (a block, or a run of sibling layers) the menu can recompute in backward: its items
    then keep nothing across the step (their rerun stores ``menu.RERUN_STORAGE`` codes for the
    region's own backward, whose error counts), the region keeps its input.
    ``delta_bytes``: what recomputing it adds to the exact-companion total beyond dropping the
    bytes of its items (its kept input, less what it keeps that no item covers); ``seconds``: its
    forward, the rerun's cost. A tensor every region saves once between them (Llama's rotary
    tables) is counted while any of them is not recomputed: with all of them recomputed the menu
    overstates by that tensor, never understates."""

    name: str
    delta_bytes: int
    seconds: float
    freed_bytes: int  # the exact-companion total less the total with it recomputed
