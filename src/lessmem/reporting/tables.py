"""Rows as text: the CSV and markdown tables of a report, and the memory benchmark's CSV."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lessmem.reporting.rows import COLUMNS, MiB, accuracy_key


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = [c for c in ("score", "complete") if any(c in r for r in rows)]
    extra += ["diverged"] if any(r.get("diverged") for r in rows) else []
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS + extra)
        for r in rows:
            w.writerow([r.get(c) for c in COLUMNS + extra])
    return path


def _fmt(v: Any, kind: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if kind == "mib":
        return f"{v / MiB:.2f}"
    if kind == "pct":
        return f"{100 * v:.2f}"
    if kind == "ratio":
        return f"{v:.3f}"
    if kind == "s":
        return f"{v:.0f}"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v)


def markdown_table(rows: Sequence[Mapping[str, Any]], front: Sequence[Mapping[str, Any]] = ()) -> str:
    """Markdown table, one line per row; ``*`` marks Pareto rows (by ``name``)."""
    on_front = {r["name"] for r in front}
    acc = accuracy_key(rows)
    score_col = acc == "score"
    head = ["config", "map", "kernels", "saved MiB", "ratio to stock", "peak MiB",
            "score" if score_col else "top-1 %", "top-5 %", "epochs", "train s", "Pareto"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        name = r["name"] + ("" if r.get("complete", True) else " (running)")
        if where := r.get("diverged"):
            name += f" (diverged: epoch {where['epoch']}, step {where['step']})"
        lines.append("| " + " | ".join([
            name, str(r.get("map")), f"`{r.get('kernels')}`", _fmt(r.get("saved_bytes"), "mib"),
            _fmt(r.get("ratio"), "ratio"), _fmt(r.get("peak_bytes"), "mib"),
            _fmt(r.get("score")) if score_col else _fmt(r.get("top1"), "pct"), _fmt(r.get("top5"), "pct"),
            str(r.get("epochs") or "—"), _fmt(r.get("train_time_s"), "s"), "*" if r["name"] in on_front else "",
        ]) + " |")
    return "\n".join(lines) + "\n"


def read_memory_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows of ``benchmarks/memory.py --csv`` (model, config, saved_mib, ratio, note)."""
    with Path(path).open() as f:
        return [{**r, "saved_mib": float(r["saved_mib"]), "ratio": float(r["ratio"])} for r in csv.DictReader(f)]
