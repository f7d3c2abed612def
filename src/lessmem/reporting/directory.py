"""A results directory (a run, a sweep or a search) and its report files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lessmem.reporting.plots import plot_accuracy_curves, plot_memory_vs_accuracy
from lessmem.reporting.rows import pareto_front
from lessmem.reporting.runs import load_runs
from lessmem.reporting.searches import is_search_dir, load_search
from lessmem.reporting.tables import markdown_table, write_csv


def load_any(root: str | Path) -> tuple[str, list[dict[str, Any]]]:
    """(``"search"`` | ``"sweep"``, rows) for a search or a run/sweep directory."""
    return ("search", load_search(root)) if is_search_dir(root) else ("sweep", load_runs(root))


def report_dir(root: str | Path, out: str | Path | None = None, title: str | None = None) -> dict[str, Any]:
    """Write ``table.md``, ``table.csv``, ``memory_vs_accuracy.png`` and ``accuracy_curves.png``
    (when any row has a history) for ``root`` into ``out`` (default ``root/report``)."""
    root = Path(root)
    out = Path(out) if out else root / "report"
    kind, rows = load_any(root)
    if not rows:
        raise FileNotFoundError(f"no runs (metrics.json / metrics.jsonl) or search trials under {root}")
    front = pareto_front(rows)
    title = title or root.name
    out.mkdir(parents=True, exist_ok=True)
    md = markdown_table(rows, front)
    (out / "table.md").write_text(f"# {title}\n\n{md}")
    files = {"table.md": out / "table.md", "table.csv": write_csv(rows, out / "table.csv"),
             "memory_vs_accuracy.png": plot_memory_vs_accuracy(rows, out / "memory_vs_accuracy.png", title)}
    if any(r.get("history") for r in rows):
        files["accuracy_curves.png"] = plot_accuracy_curves(rows, out / "accuracy_curves.png", title)
    return {"kind": kind, "rows": rows, "front": front, "markdown": md, "files": files}
