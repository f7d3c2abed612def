"""Trade-off reports from result directories: tables, memory-vs-accuracy plots, W&B tables.

Reads what ``lessmem.train.run`` and ``lessmem.search`` write, without W&B:

* a run or a sweep (Hydra multirun) directory: every ``metrics.json`` below it (runs still in
  progress are read from ``config.yaml`` + ``metrics.jsonl`` and marked incomplete);
* a search directory: ``study.journal`` (Optuna storage) or ``trials.csv``, plus the trained
  trials' ``trials/NNNN/train/metrics.json`` for accuracy searches.

One row per configuration (``COLUMNS``), used for the markdown table, the PNGs and the W&B
``Table`` (:func:`log_wandb`). The CLI scripts live in ``analysis/``.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

# One row per configuration. saved_bytes: saved-for-backward bytes of the compressed model on the
# memory batch; peak_bytes: CUDA peak of one train step (None on CPU); ratio: saved_bytes /
# stock_saved_bytes (the same model uncompressed, same batch).
COLUMNS = ["name", "map", "kernels", "saved_bytes", "stock_saved_bytes", "peak_bytes", "ratio",
           "top1", "top5", "train_time_s", "epochs"]
MiB = 2**20


# --------------------------------------------------------------------------- rows


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
                data = yaml.safe_load(cand.read_text()) or {}
                return dict(data.get("map", data)) if isinstance(data, dict) else {}
    return dict(ccfg.get("map") or {})


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
             **_checkpoint_memory(run_dir / "checkpoint.pt")}
        complete = False
    return row_from(cfg, m, name=run_dir.name, history=history, complete=complete, path=str(run_dir))


def _checkpoint_memory(path: Path) -> dict[str, Any]:
    """Saved-bytes measurement of a run still in progress (it is in its checkpoint)."""
    if not path.is_file():
        return {}
    try:
        import torch

        mem = torch.load(path, map_location="cpu", weights_only=False).get("memory") or {}
    except Exception:  # a checkpoint being replaced or from another version: no memory columns
        return {}
    return {k: v for k, v in mem.items() if k != "saved_bytes_per_layer"}


def row_from(cfg: Mapping[str, Any], metrics: Mapping[str, Any], *, name: str | None = None,
             history: list[dict[str, Any]] | None = None, complete: bool = True,
             path: str = "", base: Path | None = None) -> dict[str, Any]:
    """A ``COLUMNS`` row (plus history/path/complete) from a resolved config and metrics."""
    ccfg = cfg.get("compression") or {}
    mapping = _load_map(cfg, base or Path(path or "."))
    comp = metrics.get("compression") or ccfg.get("name") or "?"
    saved, stock = metrics.get("saved_bytes"), metrics.get("stock_saved_bytes")
    ratio = metrics.get("ratio")
    if ratio is None and saved and stock:
        ratio = saved / stock
    return {
        "name": name or comp, "map": comp, "kernels": kernel_summary(mapping),
        "saved_bytes": saved, "stock_saved_bytes": stock, "peak_bytes": metrics.get("cuda_peak_bytes"),
        "ratio": ratio, "top1": metrics.get("final_top1"), "top5": metrics.get("final_top5"),
        "train_time_s": metrics.get("train_time_s"),
        "epochs": metrics.get("epochs", len(history or [])),
        "model": metrics.get("model") or (cfg.get("model") or {}).get("name"),
        "epochs_planned": cfg.get("epochs"),
        "best_top1": metrics.get("best_top1"),
        "history": list(history if history is not None else metrics.get("history", [])),
        "complete": complete, "path": path,
    }


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


def is_search_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "study.journal").is_file() or (p / "trials.csv").is_file() or (p / "summary.json").is_file()


def load_search(root: str | Path) -> list[dict[str, Any]]:
    """One row per complete trial of a ``lessmem.search`` directory. Memory is the trial's
    conv-input bytes; accuracy is the trained top-1 when the trial trained (accuracy objective),
    else the score (mean gradient cosine). ``score`` keeps the search objective."""
    root = Path(root)
    trials = _journal_trials(root) if (root / "study.journal").is_file() else None
    if trials is None:
        trials = _csv_trials(root)
    summary = json.loads((root / "summary.json").read_text()) if (root / "summary.json").is_file() else {}
    base_bytes = summary.get("baseline_conv_input_bytes")
    rows = []
    for t in trials:
        train_dir = root / "trials" / f"{t['trial']:04d}" / "train"
        trained = run_row(train_dir) if train_dir.is_dir() else None
        kmap = t.get("map") or {}
        row = {
            "name": f"trial {t['trial']}" + (f" ({t['seed']})" if t.get("seed") else ""),
            "map": t.get("seed") or f"trial_{t['trial']:04d}", "kernels": kernel_summary(kmap or t.get("params")),
            "saved_bytes": t["conv_input_bytes"], "stock_saved_bytes": base_bytes, "peak_bytes": None,
            "ratio": t["conv_input_bytes"] / base_bytes if base_bytes else None,
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
            if "conv_input_bytes" not in a or "score" not in a:
                continue
            out.append({"trial": t.number, "seed": a.get("seed", ""), "conv_input_bytes": a["conv_input_bytes"],
                        "score": a["score"], "map": a.get("map") or {},
                        "params": {k.removeprefix("k:"): v for k, v in t.params.items()}})
    return out


def _csv_trials(root: Path) -> list[dict[str, Any]]:
    path = root / "trials.csv"
    if not path.is_file():
        return []
    out = []
    with path.open() as f:
        for r in csv.DictReader(f):
            out.append({"trial": int(r["trial"]), "seed": r.get("seed", ""),
                        "conv_input_bytes": int(float(r["conv_input_bytes"])), "score": float(r["score"]),
                        "params": json.loads(r.get("params") or "{}")})
    return out


def accuracy_key(rows: Sequence[Mapping[str, Any]]) -> str:
    """``top1`` when any row has it, else ``score`` (fidelity searches)."""
    return "top1" if any(r.get("top1") is not None for r in rows) else "score"


def pareto_front(rows: Sequence[Mapping[str, Any]], mem: str = "saved_bytes", acc: str | None = None) -> list[dict[str, Any]]:
    """Non-dominated rows for (min ``mem``, max ``acc``), sorted by memory; one per point."""
    acc = acc or accuracy_key(rows)
    pts = [r for r in rows if _num(r.get(mem)) and _num(r.get(acc))]
    front: list[dict[str, Any]] = []
    for r in sorted(pts, key=lambda r: (r[mem], -r[acc])):
        if not front or r[acc] > front[-1][acc]:
            front.append(dict(r))
    return front


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def table_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    """``COLUMNS``-ordered values (for wandb.Table / CSV)."""
    return [[r.get(c) for c in COLUMNS] for r in rows]


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = [c for c in ("score", "complete") if any(c in r for r in rows)]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS + extra)
        for r in rows:
            w.writerow([r.get(c) for c in COLUMNS + extra])
    return path


# --------------------------------------------------------------------------- markdown


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
        lines.append("| " + " | ".join([
            name, str(r.get("map")), f"`{r.get('kernels')}`", _fmt(r.get("saved_bytes"), "mib"),
            _fmt(r.get("ratio"), "ratio"), _fmt(r.get("peak_bytes"), "mib"),
            _fmt(r.get("score")) if score_col else _fmt(r.get("top1"), "pct"), _fmt(r.get("top5"), "pct"),
            str(r.get("epochs") or "—"), _fmt(r.get("train_time_s"), "s"), "*" if r["name"] in on_front else "",
        ]) + " |")
    return "\n".join(lines) + "\n"


def parse_markdown_table(text: str) -> list[dict[str, str]]:
    """Rows of the first markdown table in ``text`` as header -> cell dicts."""
    lines = [s.strip() for s in text.splitlines()]
    out: list[dict[str, str]] = []
    header: list[str] | None = None
    for s in lines:
        if not s.startswith("|"):
            if header is not None and out:
                break
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        if header is None:
            header = cells
        elif set("".join(cells)) <= set("-: "):
            continue
        else:
            out.append(dict(zip(header, cells, strict=False)))
    return out


# --------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_memory_vs_accuracy(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "",
                            mem: str = "saved_bytes") -> Path:
    """Scatter of memory (MiB) vs accuracy, Pareto front as a red line, every point labelled
    when there are few."""
    plt = _plt()
    acc = accuracy_key(rows)
    pts = [r for r in rows if _num(r.get(mem)) and _num(r.get(acc))]
    front = pareto_front(pts, mem, acc)
    scale = 100.0 if acc == "top1" else 1.0
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter([r[mem] / MiB for r in pts], [r[acc] * scale for r in pts], s=22, color="0.55",
               label="configurations", zorder=2)
    if front:
        ax.plot([r[mem] / MiB for r in front], [r[acc] * scale for r in front], "o-", color="tab:red",
                ms=6, label="Pareto front", zorder=3)
    if len(pts) <= 12:
        for r in pts:
            ax.annotate(str(r.get("map") or r["name"]), (r[mem] / MiB, r[acc] * scale), fontsize=8,
                        xytext=(5, 4), textcoords="offset points")
    ax.set_xlabel("saved-for-backward MiB" if mem == "saved_bytes" else f"{mem} (MiB)")
    ax.set_ylabel("val top-1 (%)" if acc == "top1" else "score (mean weight-gradient cosine)")
    ax.set_title(title or "memory vs accuracy", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_accuracy_curves(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Val top-1 (and train top-1, dashed) per epoch for each configuration."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    drawn = 0
    for i, r in enumerate(rows):
        hist = [h for h in r.get("history") or [] if "val_top1" in h]
        if not hist:
            continue
        color = f"C{i % 10}"
        ep = [h["epoch"] for h in hist]
        ax.plot(ep, [100 * h["val_top1"] for h in hist], "o-", color=color, ms=4,
                label=f"{r.get('map') or r['name']} val" + ("" if r.get("complete", True) else " (running)"))
        if all("train_top1" in h for h in hist):
            ax.plot(ep, [100 * h["train_top1"] for h in hist], "--", color=color, alpha=0.6, lw=1)
        drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no per-epoch history", ha="center", va="center", transform=ax.transAxes)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    planned = [int(r["epochs_planned"]) for r in rows if r.get("epochs_planned")]
    if planned:
        ax.set_xlim(0.5, max(planned) + 0.5)
    ax.set_xlabel("epoch")
    ax.set_ylabel("top-1 (%)  (solid: val, dashed: train)")
    ax.set_title(title or "accuracy per epoch", fontsize=10)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def block_of(layer: str) -> str:
    """``layer1.0.conv1`` -> ``layer1.0``; ``features.3.conv.0`` -> ``features.3``; ``bn1`` -> ``stem``
    (top-level modules before the first stage); ``''`` (functional ops) -> ``(functional)``."""
    if not layer:
        return "(functional)"
    parts = layer.split(".")
    if len(parts) >= 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    if parts[0] in ("conv1", "bn1", "relu", "maxpool"):
        return "stem"
    return parts[0]


def per_layer_memory(model_name: str, mapping: Mapping[str, Any], *, batch: int = 32, size: int = 224,
                     num_classes: int = 1000, compress_kwargs: Mapping[str, Any] | None = None,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Stock vs compressed saved bytes per block (``block_of``) of ``model_name``, with
    ``lessmem.measure_memory(...).per_layer``. Rows keep the model's block order."""
    import copy

    import torch

    from lessmem.core import compress, measure_memory
    from lessmem.models import build_model

    torch.manual_seed(seed)
    model = build_model(model_name, num_classes=num_classes).train()
    x = torch.randn(batch, 3, size, size)
    stock = measure_memory(model, x).per_layer
    comp_model = compress(copy.deepcopy(model), dict(mapping), **dict(compress_kwargs or {}))
    comp = measure_memory(comp_model, x).per_layer
    order: OrderedDict[str, None] = OrderedDict()
    for name, _ in model.named_modules():
        if name:
            order[block_of(name)] = None
    sums: dict[str, list[int]] = {}
    for i, per in enumerate((stock, comp)):
        for layer, b in per.items():
            sums.setdefault(block_of(layer), [0, 0])[i] += b
    keys = [k for k in order if k in sums] + [k for k in sums if k not in order]
    return [{"block": k, "stock_bytes": sums[k][0], "compressed_bytes": sums[k][1]} for k in keys]


def plot_per_layer(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "",
                   label: str = "compressed") -> Path:
    """Horizontal bars, stock vs compressed MiB per block."""
    plt = _plt()
    n = len(rows)
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.32 * n))
    ys = list(range(n))[::-1]
    h = 0.4
    ax.barh([y + h / 2 for y in ys], [r["stock_bytes"] / MiB for r in rows], h, color="0.6", label="stock PyTorch")
    ax.barh([y - h / 2 for y in ys], [r["compressed_bytes"] / MiB for r in rows], h, color="tab:blue", label=label)
    ax.set_yticks(ys, [r["block"] for r in rows], fontsize=8)
    ax.set_xlabel("saved-for-backward MiB")
    ax.set_title(title or "saved bytes per block", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_ratio_bars(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Grouped bars of ratio to stock per model (groups) and config (bars); ``rows`` have
    model, config, ratio (e.g. ``benchmarks/memory.py --csv``)."""
    plt = _plt()
    models = list(OrderedDict.fromkeys(r["model"] for r in rows))
    configs = list(OrderedDict.fromkeys(r["config"] for r in rows))
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(max(6.5, 1.0 + 1.6 * len(models)), 4.5))
    for j, c in enumerate(configs):
        xs, ys = [], []
        for i, m in enumerate(models):
            val = next((float(r["ratio"]) for r in rows if r["model"] == m and r["config"] == c), None)
            if val is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(val)
        bars = ax.bar(xs, ys, width, label=c, color=f"C{j % 10}")
        for b, v in zip(bars, ys, strict=True):
            ax.text(b.get_x() + b.get_width() / 2, v + 0.01, f"{v:.2f}", ha="center", fontsize=6, rotation=90)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("saved-for-backward bytes / stock")
    ax.set_ylim(0, 1.45)
    ax.set_title(title or "saved bytes relative to stock PyTorch", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


# --------------------------------------------------------------------------- whole reports


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


# --------------------------------------------------------------------------- W&B


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
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            png = plot_memory_vs_accuracy(rows, Path(tmp) / "mva.png")
            payload[f"{key}/memory_vs_accuracy_png"] = wandb.Image(str(png))
            run.log(payload)
        return payload
    run.log(payload)
    return payload


def _wandb_cell(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


def log_dir_to_wandb(root: str | Path, *, project: str = "lessmem", mode: str = "offline",
                     name: str | None = None) -> dict[str, Any]:
    """One W&B run (job_type ``report``) with the table/plots of a sweep or search directory."""
    import os

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


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object


class WandbSweepCallback(_HydraCallback):
    """Hydra callback: after a multirun, log the sweep's table and plots to W&B (offline).

        python -m lessmem.cli.train -m compression=none,pool2,pool4 \\
            +hydra.callbacks.tradeoff._target_=lessmem.reporting.WandbSweepCallback
    """

    def __init__(self, project: str = "lessmem", mode: str = "offline") -> None:
        self.project, self.mode = project, mode

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if load_runs(sweep_dir):
            log_dir_to_wandb(sweep_dir, project=self.project, mode=self.mode)
            report_dir(sweep_dir)


def read_memory_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows of ``benchmarks/memory.py --csv`` (model, config, saved_mib, ratio, note)."""
    with Path(path).open() as f:
        return [{**r, "saved_mib": float(r["saved_mib"]), "ratio": float(r["ratio"])} for r in csv.DictReader(f)]


def iter_pngs(files: Mapping[str, Path]) -> Iterable[Path]:
    return (p for p in files.values() if str(p).endswith(".png"))
