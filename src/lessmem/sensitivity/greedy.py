"""The greedy per-layer map: most bytes saved per fidelity lost, until a budget is met."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from lessmem.sensitivity.groups import group_layers

if TYPE_CHECKING:
    from lessmem.sensitivity.result import SensitivityResult

log = logging.getLogger(__name__)


def greedy_map(result: SensitivityResult, budget: float | None, min_cosine: float | None,
               groups: Sequence[str] | None = None) -> dict[str, int]:
    """Start at k=1 everywhere; repeatedly apply the upgrade (one unit to its next larger kernel)
    with the most saved bytes per fidelity lost (sum of cosine drops), until the bytes are within
    ``budget`` (bytes; None: no budget), skipping upgrades that would put a layer below
    ``min_cosine``.

    groups: fnmatch patterns; the layers matching one pattern move together (one unit).
    Layers sharing an input also get a joint move, since upgrading only one of them stores
    an extra pooled copy instead of saving anything.
    """
    units = group_layers(result.layers, groups)
    moves = list(units.values()) + _joint_moves(result, units)
    kmap = dict.fromkeys(result.layers, 1)
    while budget is None or result.saved_bytes(kmap) > budget:
        best = _best_move(result, kmap, moves, min_cosine)
        if best is None:
            if budget is not None:
                log.warning("make_map: budget %d B not reached (%d B); min_cosine=%s stops it",
                            budget, result.saved_bytes(kmap), min_cosine)
            break
        kmap = best
    return kmap


def _joint_moves(result: SensitivityResult, units: Mapping[str, list[str]]) -> list[list[str]]:
    owner = {layer: u for u, members in units.items() for layer in members}
    joint: list[list[str]] = []
    for g in sorted(set(result.input_group)):
        sharing = {owner[n] for n, gi in zip(result.layers, result.input_group, strict=True) if gi == g}
        if len(sharing) > 1:
            joint.append([n for u in sorted(sharing) for n in units[u]])
    return joint


def _best_move(result: SensitivityResult, kmap: dict[str, int], moves: list[list[str]],
               min_cosine: float | None) -> dict[str, int] | None:
    before_bytes = result.saved_bytes(kmap)
    cos = result.layer_cosines(kmap)
    best, best_score = None, -math.inf
    for move in moves:
        cand = _upgrade(result.kernels, kmap, move)
        if cand is None:
            continue
        saving = before_bytes - result.saved_bytes(cand)
        new_cos = result.layer_cosines(cand)
        if saving <= 0 or (min_cosine is not None and any(new_cos[n] < min_cosine for n in move)):
            continue
        lost = sum(cos[n] - new_cos[n] for n in move)
        score = saving / max(lost, 1e-12)
        if score > best_score:
            best, best_score = cand, score
    return best


def _upgrade(kernels: Sequence[int], kmap: dict[str, int], move: list[str]) -> dict[str, int] | None:
    # Every layer of the move goes to the next kernel above the move's smallest one.
    current = min(kmap[n] for n in move)
    larger = [k for k in kernels if k > current]
    if not larger:
        return None
    return {**kmap, **dict.fromkeys(move, larger[0])}
