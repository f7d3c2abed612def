"""Coverage files of a configured model: which saved tensors are compressed and which stay
full size (``coverage.csv``, ``coverage.json`` with rows + totals, ``coverage.png``)."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from lessmem.core import CoverageReport, coverage
from lessmem.experiment.model import build_model_from_cfg, compress_as_configured
from lessmem.experiment.task import task_of


def coverage_for_config(cfg: DictConfig, batch: int | None = None) -> CoverageReport:
    """Coverage of the configured model and compression map on a random input batch of the
    task's shape (saved bytes depend on shapes only, not on pixel values or token ids)."""
    task = task_of(cfg)
    torch.manual_seed(int(cfg.get("seed", 0)))
    model = build_model_from_cfg(cfg).train()
    compress_as_configured(model, cfg)
    return coverage(model, task.random_inputs(cfg.dataset, int(batch or cfg.memory_batch)))


def write_coverage(model: nn.Module, x: Tensor, out_dir: Path, title: str) -> CoverageReport:
    """Coverage of ``model`` on ``x``, written to ``out_dir`` (coverage.csv/json/png)."""
    report = coverage(model, x)
    save_report(report, out_dir, title)
    return report


def save_report(report: CoverageReport, out: Path, title: str = "") -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "coverage.csv", "json": out / "coverage.json", "png": out / "coverage.png"}
    records = report.as_records()
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    paths["json"].write_text(json.dumps({"summary": report.summary(), "rows": records}, indent=1))
    plot_layers(report, paths["png"], title)
    return paths


def plot_layers(report: CoverageReport, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compressed: dict[str, int] = defaultdict(int)
    full: dict[str, int] = defaultdict(int)
    for r in report.rows:
        (compressed if r.compressed else full)[r.layer] += r.bytes
    layers = list(dict.fromkeys(r.layer for r in report.rows))
    mib = 2**20
    fig, ax = plt.subplots(figsize=(max(8, 0.22 * len(layers)), 4.5))
    xs = range(len(layers))
    full_v = [full[n] / mib for n in layers]
    ax.bar(xs, full_v, color="#d62728", label="kept full size")
    ax.bar(xs, [compressed[n] / mib for n in layers], bottom=full_v, color="#2ca02c",
           label="compressed (pooled / bits / uint8)")
    ax.set_xticks(list(xs), layers, rotation=90, fontsize=6)
    ax.set_ylabel("saved for backward (MiB)")
    s = report.summary()
    note = f"total {s['total_bytes'] / mib:.1f} MiB"
    if s["stock_bytes"]:
        note += f" = {s['share_of_stock']:.3f}x stock; exact-propagation floor {s['floor_share_of_stock']:.3f}x"
    ax.set_title(f"{title}\n{note}" if title else note, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
