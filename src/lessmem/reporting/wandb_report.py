"""Rows as W&B views: a ``wandb.Table``, a memory-vs-accuracy scatter, the Pareto front."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lessmem.reporting.directory import load_any
from lessmem.reporting.plots import plot_memory_vs_accuracy
from lessmem.reporting.rows import COLUMNS, accuracy_key, pareto_front


def log_wandb(run: Any, rows: Sequence[Mapping[str, Any]], *, key: str = "tradeoff", pareto: bool = False,
              image: bool = True) -> dict[str, Any]:
    """Log a ``wandb.Table`` (``COLUMNS``, one row per configuration), a memory-vs-accuracy
    scatter and, with ``pareto``, the Pareto front as a line, plus (``image``) the matplotlib
    figure. ``run`` is a ``wandb`` run (offline works; ``wandb sync`` later)."""
    import wandb

    acc = accuracy_key(rows)
    cols = COLUMNS + (["score"] if acc == "score" else [])
    data = [[_wandb_cell(r.get(c)) for c in cols] for r in rows]
    table = wandb.Table(columns=cols, data=data)
    payload: dict[str, Any] = {
        f"{key}/table": table,
        f"{key}/memory_vs_accuracy": wandb.plot.scatter(table, "saved_bytes", acc,
                                                        title="saved-for-backward bytes vs " + acc),
    }
    if pareto:
        front = pareto_front(rows, acc=acc)
        ftable = wandb.Table(columns=cols, data=[[_wandb_cell(r.get(c)) for c in cols] for r in front])
        payload[f"{key}/pareto_table"] = ftable
        payload[f"{key}/pareto_front"] = wandb.plot.line(ftable, "saved_bytes", acc, title="Pareto front")
    if image and rows:
        with tempfile.TemporaryDirectory() as tmp:
            png = plot_memory_vs_accuracy(rows, Path(tmp) / "mva.png")
            payload[f"{key}/memory_vs_accuracy_png"] = wandb.Image(str(png))
            run.log(payload)  # while the PNG still exists
        return payload
    run.log(payload)
    return payload


def _wandb_cell(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


def log_dir_to_wandb(root: str | Path, *, project: str = "lessmem", mode: str = "offline",
                     name: str | None = None) -> dict[str, Any]:
    """One W&B run (job_type ``report``) with the table/plots of a sweep or search directory."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    kind, rows = load_any(root)
    if not rows:
        raise FileNotFoundError(f"no runs or search trials under {root}")
    run = wandb.init(project=project, mode=mode, job_type="report", name=name or f"{kind}:{Path(root).name}",
                     dir=str(root), config={"source": str(root), "kind": kind})
    try:
        payload = log_wandb(run, rows, key=kind, pareto=True)
    finally:
        run.finish()
    return payload
