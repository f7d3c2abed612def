"""PNG figures of rows: memory vs accuracy, accuracy per epoch, ratio bars, saved bytes per block."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lessmem.reporting.rows import MiB, accuracy_key, is_number, pareto_front


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend: figures are only saved, never shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def plot_memory_vs_accuracy(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "",
                            mem: str = "saved_bytes") -> Path:
    """Scatter of memory (MiB) vs accuracy, Pareto front as a red line, every point labelled
    when there are few."""
    plt = pyplot()
    acc = accuracy_key(rows)
    pts = [r for r in rows if is_number(r.get(mem)) and is_number(r.get(acc))]
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
    return save_figure(fig, path)


def plot_accuracy_curves(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Val top-1 (and train top-1, dashed) per epoch for each configuration."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

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
    return save_figure(fig, path)


def plot_per_layer(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "",
                   label: str = "compressed") -> Path:
    """Horizontal bars, stock vs compressed MiB per block (rows of ``per_layer_memory``)."""
    plt = pyplot()
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
    return save_figure(fig, path)


def plot_ratio_bars(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Grouped bars of ratio to stock per model (groups) and config (bars); ``rows`` have
    model, config, ratio (e.g. ``benchmarks/memory.py --csv``)."""
    plt = pyplot()
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
    return save_figure(fig, path)


def plot_batch_plan(rows: Sequence[Mapping[str, Any]], budget_bytes: float, path: str | Path, title: str = "") -> Path:
    """A memory budget's batch plan: the best map's predicted whole-step peak against the budget
    (left) and its predicted whole-gradient error (right) per batch size; batch sizes where
    nothing fits are marked at the floor's predicted peak."""
    plt = pyplot()
    fig, (peak_ax, err_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
    fits = [r for r in rows if r["fits"]]
    over = [r for r in rows if not r["fits"]]
    peak_ax.plot([r["batch_size"] for r in fits], [r["predicted_peak_bytes"] / MiB for r in fits], "o-",
                 label="best map (predicted)")
    if over:
        peak_ax.plot([r["batch_size"] for r in over], [r["predicted_peak_bytes"] / MiB for r in over], "x",
                     color="red", label="nothing fits (floor)")
    peak_ax.axhline(budget_bytes / MiB, color="black", ls=":", label="budget")
    peak_ax.set(xlabel="batch size", ylabel="whole-step peak (MiB)")
    peak_ax.legend(fontsize=8)
    # log scale; an exact map (error 0) is drawn at 1e-12
    err_ax.plot([r["batch_size"] for r in fits], [max(r["grad_error"], 1e-12) for r in fits], "o-")
    err_ax.set(xlabel="batch size", ylabel="predicted whole-gradient error", yscale="log", xlim=peak_ax.get_xlim())
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)
