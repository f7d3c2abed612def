"""A trial's objective values from what its task returned."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def objective_values(returned: Any, objectives: Sequence[str]) -> list[float]:
    """A mapping is read at the ``objectives`` keys (e.g. a metrics dict); a sequence gives one
    value per objective, in order; anything else is the single objective's value. Raises
    ValueError when the values don't fit: the trial then fails."""
    if isinstance(returned, Mapping):
        missing = [key for key in objectives if key not in returned]
        if missing:
            raise ValueError(f"the task's return has no {missing}; it has {sorted(map(str, returned))}")
        raw = [returned[key] for key in objectives]
    elif isinstance(returned, Sequence) and not isinstance(returned, str):
        raw = list(returned)
    else:
        raw = [returned]
    if len(raw) != len(objectives):
        raise ValueError(f"expected {len(objectives)} objective value(s) {list(objectives)}, "
                         f"the task returned {len(raw)}")
    return [_finite(name, value) for name, value in zip(objectives, raw, strict=True)]


def _finite(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"objective {name}: {value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"objective {name} is {number}")
    return number
