"""The Pareto front of rows: least memory for the accuracy (or score) it reaches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lessmem.reporting.rows import accuracy_key, is_number


def pareto_front(rows: Sequence[Mapping[str, Any]], mem: str = "saved_bytes",
                 acc: str | None = None) -> list[dict[str, Any]]:
    """Non-dominated rows for (min ``mem``, max ``acc``; default: :func:`accuracy_key`), sorted
    by memory; one per point (the first of equal rows). Rows without finite values are left out."""
    acc = acc or accuracy_key(rows)
    pts = [r for r in rows if is_number(r.get(mem)) and is_number(r.get(acc))]
    front: list[dict[str, Any]] = []
    for r in sorted(pts, key=lambda r: (r[mem], -r[acc])):
        if not front or r[acc] > front[-1][acc]:
            front.append(dict(r))
    return front
