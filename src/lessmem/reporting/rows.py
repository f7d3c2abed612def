"""The row model: one row per configuration, the same for runs, sweeps and search trials."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lessmem.core import CompressionPlan

# saved_bytes: saved-for-backward bytes of the compressed model on the memory batch; peak_bytes:
# whole-step peak of one train step on that batch (the CPU allocator's tensor bytes, or CUDA's
# max_memory_allocated; older runs: CUDA only); ratio: saved_bytes / stock_saved_bytes (the same
# model uncompressed, same batch).
COLUMNS = ["name", "map", "map_hash", "kernels", "saved_bytes", "stock_saved_bytes", "peak_bytes", "ratio",
           "top1", "top5", "train_time_s", "epochs"]
MiB = 2**20


def kernel_summary(mapping: Mapping[str, Any] | None) -> str:
    """Short text for a pattern -> kernel map: ``*:2`` for a few patterns, else a kernel histogram
    (``k1 x3, k2 x14, k4 x3``) for per-layer maps."""
    if not mapping:
        return "none"
    items = {str(k): v for k, v in mapping.items()}
    if len(items) <= 4:
        return ", ".join(f"{p}:{_kernel_str(k)}" for p, k in items.items())
    counts = Counter(_kernel_str(k) for k in items.values())
    return ", ".join(f"k{k} x{n}" for k, n in sorted(counts.items(), key=lambda kv: str(kv[0])))


def _kernel_str(k: Any) -> str:
    if isinstance(k, (list, tuple)):
        return "x".join(str(v) for v in k)
    return str(k)


def _load_map(cfg: Mapping[str, Any], base: Path) -> dict[str, Any]:
    ccfg = cfg.get("compression") or {}
    path = ccfg.get("map_file")
    if path:
        p = Path(path)
        for cand in (p, base / p, base / p.name):
            if cand.is_file():
                return dict(CompressionPlan.read(cand).map)
    return dict(ccfg.get("map") or {})


def row_from(cfg: Mapping[str, Any], metrics: Mapping[str, Any], *, name: str | None = None,
             history: list[dict[str, Any]] | None = None, complete: bool = True,
             path: str = "", base: Path | None = None) -> dict[str, Any]:
    """A ``COLUMNS`` row (plus history/path/complete/diverged) from a resolved config and metrics."""
    ccfg = cfg.get("compression") or {}
    # Runs record their map, its name and hash (the config alone can mislabel a map_file run).
    mapping = metrics.get("compression_map")
    if mapping is None:
        mapping = _load_map(cfg, base or Path(path or "."))
    comp = metrics.get("compression") or ccfg.get("name") or "?"
    saved, stock = metrics.get("saved_bytes"), metrics.get("stock_saved_bytes")
    ratio = metrics.get("ratio")
    if ratio is None and saved and stock:
        ratio = saved / stock
    return {
        "name": name or comp, "map": comp, "map_hash": metrics.get("compression_hash"),
        "kernels": kernel_summary(mapping),
        "saved_bytes": saved, "stock_saved_bytes": stock, "peak_bytes": metrics.get("step_peak_bytes", metrics.get("cuda_peak_bytes")),
        "ratio": ratio, "top1": metrics.get("final_top1"), "top5": metrics.get("final_top5"),
        "train_time_s": metrics.get("train_time_s"),
        "epochs": metrics.get("epochs", len(history or [])),
        "model": metrics.get("model") or (cfg.get("model") or {}).get("name"),
        "epochs_planned": cfg.get("epochs"),
        "best_top1": metrics.get("best_top1"),
        "history": list(history if history is not None else metrics.get("history", [])),
        "complete": complete, "path": path, "diverged": metrics.get("diverged"),
    }


def accuracy_key(rows: Sequence[Mapping[str, Any]]) -> str:
    """``top1`` when any row has it, else ``score`` (search trials without a training run)."""
    return "top1" if any(r.get("top1") is not None for r in rows) else "score"


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool, None or NaN): a value that can be plotted and ranked."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


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
