"""Rows of a ``lessmem.search`` directory: its Optuna journal (or ``trials.csv``), plus the
trained trials' run directories."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from lessmem.core import CompressionPlan
from lessmem.reporting.rows import kernel_summary
from lessmem.reporting.runs import run_row


def is_search_dir(path: str | Path) -> bool:
    p = Path(path)
    # A study's files; a summary.json beside run directories is an analysis summary, not a search's.
    summary = (p / "summary.json").is_file() and not (p / "runs").is_dir()
    return (p / "study.journal").is_file() or (p / "trials.csv").is_file() or summary


def load_search(root: str | Path) -> list[dict[str, Any]]:
    """One row per complete trial of a ``lessmem.search`` directory. Memory is the trial map's
    total saved bytes as the menu predicts them (``measured_*``: what its training run measured);
    accuracy is the trained top-1 (a trial that met an earlier map (``same_as``) has none).
    ``score`` keeps the search's score."""
    root = Path(root)
    trials = _journal_trials(root) if (root / "study.journal").is_file() else None
    if trials is None:
        trials = _csv_trials(root)
    rows = []
    for t in trials:
        train_dir = root / "trials" / f"{t['trial']:04d}" / "train"
        trained = run_row(train_dir) if train_dir.is_dir() else None
        saved, ratio = t["saved_bytes"], t["ratio"]
        row = {
            "name": f"trial {t['trial']}" + (f" ({t['seed']})" if t.get("seed") else ""),
            "map": t.get("seed") or f"trial_{t['trial']:04d}", "kernels": kernel_summary(_map_of(t["map_file"])),
            "saved_bytes": saved, "stock_saved_bytes": round(saved / ratio) if saved and ratio else None,
            "peak_bytes": None, "ratio": ratio,
            "top1": None, "top5": None, "train_time_s": None, "epochs": 0, "history": [],
            "complete": True, "path": str(train_dir if trained else root), "trial": t["trial"],
            "score": t["score"], "seed": t.get("seed", ""),
        }
        if trained:
            for k in ("top1", "top5", "train_time_s", "epochs", "history", "peak_bytes"):
                row[k] = trained[k]
            row["measured_saved_bytes"], row["measured_ratio"] = trained["saved_bytes"], trained["ratio"]
        rows.append(row)
    return rows


def _map_of(map_file: str) -> dict[str, Any]:
    path = Path(map_file) if map_file else None
    if path is None or not path.is_file():
        return {}
    return dict(CompressionPlan.read(path).map)


def _journal_trials(root: Path) -> list[dict[str, Any]] | None:
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(root / "study.journal")))
    studies = storage.get_all_studies()
    if not studies:
        return None
    out = []
    for s in studies:
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            a = t.user_attrs
            if "saved_bytes" not in a or "score" not in a:
                continue
            out.append({"trial": t.number, "seed": a.get("seed", ""), "saved_bytes": a["saved_bytes"],
                        "ratio": a["ratio"], "score": a["score"], "map_file": a.get("map_file", "")})
    return out


def _csv_trials(root: Path) -> list[dict[str, Any]]:
    path = root / "trials.csv"
    if not path.is_file():
        return []
    out = []
    with path.open() as f:
        for r in csv.DictReader(f):
            if r["state"] != "complete":
                continue
            out.append({"trial": int(r["trial"]), "seed": r.get("seed", ""),
                        "saved_bytes": int(float(r["saved_bytes"])), "ratio": float(r["ratio"]),
                        "score": float(r["score"]), "map_file": r.get("map_file", "")})
    return out
