"""Multiple-choice knapsack: one option per unit, least total cost value within a byte capacity.

Dynamic programming over the capacity cut into steps; each option's bytes are rounded *up* to whole
steps, so a solution never exceeds the capacity. It may leave up to one step per unit unused: at
least ``STEPS_PER_UNIT`` steps per unit keep that within 1/STEPS_PER_UNIT of the capacity (a 135M
Llama with LoRA has some 400 units; at a fixed 4,000 steps its smallest map missed a capacity 1%
above it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

STEPS_PER_UNIT = 200


def least_value_choice(values: Sequence[Sequence[float]], nbytes: Sequence[Sequence[int]], capacity: float,
                       resolution: int = 4000) -> list[int] | None:
    """Per unit, the index of its chosen option: minimal sum of ``values`` with the sum of
    ``nbytes`` within ``capacity``; None when even the smallest options do not fit. Options with a
    non-finite value are never chosen."""
    if capacity < 0:
        return None
    step = max(capacity / max(resolution, STEPS_PER_UNIT * len(values)), 1e-9)
    slots = int(math.floor(capacity / step + 1e-9)) + 1
    best = np.full(slots, np.inf)
    best[0] = 0.0  # best[c]: least value using exactly c steps
    picks: list[np.ndarray] = []
    for unit_values, unit_bytes in zip(values, nbytes, strict=True):
        nxt = np.full(slots, np.inf)
        pick = np.full(slots, -1, dtype=np.int16)
        for j, (v, b) in enumerate(zip(unit_values, unit_bytes, strict=True)):
            w = int(math.ceil(b / step - 1e-9)) if b > 0 else 0
            if not math.isfinite(v) or w >= slots:
                continue
            cand = np.full(slots, np.inf)
            cand[w:] = best[: slots - w] + v
            better = cand < nxt
            nxt[better], pick[better] = cand[better], j
        best = nxt
        picks.append(pick)
    if not np.isfinite(best).any():
        return None
    c = int(np.argmin(best))
    choice = [0] * len(picks)
    for u in range(len(picks) - 1, -1, -1):
        j = int(picks[u][c])
        choice[u] = j
        b = nbytes[u][j]
        c -= int(math.ceil(b / step - 1e-9)) if b > 0 else 0
    return choice
