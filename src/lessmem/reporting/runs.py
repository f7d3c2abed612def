"""Rows of training run directories: finished runs from ``metrics.json``, runs in progress from
``metrics.jsonl`` + ``memory.json``. Only JSON and YAML are read: never a checkpoint, whose
pickle could run code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from lessmem.reporting.rows import row_from


def run_row(run_dir: Path) -> dict[str, Any] | None:
    """The row of one training run directory, or None when it has neither metrics file."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text()) if cfg_path.is_file() else {}
    final = run_dir / "metrics.json"
    if final.is_file():
        m = json.loads(final.read_text())
        history, complete = m.get("history", []), True
    else:
        lines = run_dir / "metrics.jsonl"
        if not lines.is_file():
            return None
        history = [json.loads(s) for s in lines.read_text().splitlines() if s.strip()]
        if not history:
            return None
        last = history[-1]
        m = {"final_top1": last.get("val_top1"), "final_top5": last.get("val_top5"),
             "train_time_s": sum(h.get("epoch_time_s", 0.0) for h in history), "epochs": len(history),
             **_running_memory(run_dir / "memory.json")}
        complete = False
    return row_from(cfg, m, name=run_dir.name, history=history, complete=complete, path=str(run_dir))


def _running_memory(path: Path) -> dict[str, Any]:
    """Saved-bytes measurement of a run in progress (written before its first epoch; runs of
    older versions have none)."""
    return json.loads(path.read_text()) if path.is_file() else {}


def load_runs(root: str | Path) -> list[dict[str, Any]]:
    """Rows of every run below ``root`` (itself included), sorted by directory name."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = {p.parent for pat in ("metrics.json", "metrics.jsonl") for p in root.rglob(pat)
            if "wandb" not in p.parts}
    rows = [r for d in sorted(dirs) if (r := run_row(d)) is not None]
    return _short_names(rows)


def _short_names(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hydra multirun dirs (``3_batch_size=128,compression=pool2,...``) -> ``3_compression=pool2``:
    only the overrides that differ between the runs."""
    parsed = []
    for r in rows:
        num, _, rest = r["name"].partition("_")
        items = [kv for kv in rest.split(",") if "=" in kv]
        if not num.isdigit() or not items:
            return rows
        parsed.append((num, dict(kv.split("=", 1) for kv in items)))
    keys = {k for _, d in parsed for k in d}
    varying = [k for k in sorted(keys) if len({d.get(k) for _, d in parsed}) > 1]
    for r, (num, d) in zip(rows, parsed, strict=True):
        r["name"] = num + "_" + ",".join(f"{k}={d[k]}" for k in varying if k in d) if varying else r["name"]
    return rows
