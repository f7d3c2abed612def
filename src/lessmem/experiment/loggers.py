"""What a run reports while it trains: experiment trackers behind one small interface (W&B
offline / online, CSV, or nothing), the line each epoch ends with (within an epoch:
``progress``), and the coverage files (which saved tensors are compressed and which
stay full size: ``coverage.csv``, ``coverage.json`` with rows + totals, ``coverage.png``)."""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from lessmem.core import CoverageReport, coverage
from lessmem.experiment.compression import (
    compress_model,
    compression_given,
    resolve_compression,
)
from lessmem.experiment.spec import LogSpec, model_spec
from lessmem.experiment.task import task_of


class Logger:
    """No-op base (``logger=disabled``)."""

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        pass

    def summary(self, values: dict[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass

    def table(self, key: str, records: list[dict[str, Any]]) -> None:
        """A table of rows (e.g. the coverage report); only trackers with tables keep it."""

    def results(self, metrics: dict[str, Any]) -> None:
        """End of run: the run's row of the trade-off table (W&B only)."""


class CsvLogger(Logger):
    """Appends one row per ``log`` call to ``out_dir/metrics.csv`` (columns fixed by the first row)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / "metrics.csv"
        self.fields: list[str] | None = None
        if self.path.exists():  # resumed run: keep the existing header
            with self.path.open() as f:
                self.fields = next(csv.reader(f), None)

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        row = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str)) or v is None}
        new = self.fields is None
        if new:
            self.fields = list(row)
        with self.path.open("a", newline="") as f:
            writer = csv.DictWriter(f, self.fields, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)


class WandbLogger(Logger):
    def __init__(self, config: dict[str, Any], lcfg: Mapping[str, Any], out_dir: Path, resume_id: str | None) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.cfg = config
        self.run = wandb.init(
            project=lcfg.get("project", "lessmem"),
            entity=lcfg.get("entity"),
            group=lcfg.get("group"),
            name=lcfg.get("run_name"),
            tags=list(lcfg.get("tags") or []),
            mode=lcfg.get("mode", "offline"),
            config=config,
            dir=str(out_dir),
            id=resume_id,
            resume="allow" if resume_id else None,
        )
        # Epoch-level curves use "epoch" as x axis; step-level ones (grad cosine) use "step".
        self.run.define_metric("epoch")
        for prefix in ("train/*", "val/*", "lr", "time/*"):
            self.run.define_metric(prefix, step_metric="epoch")
        self.run.define_metric("step")
        self.run.define_metric("grad_cosine/*", step_metric="step")
        self.run.define_metric("val/top1", step_metric="epoch", summary="max")

    @property
    def id(self) -> str:
        return self.run.id

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.run.log(metrics)

    def summary(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            self.run.summary[k] = v

    def results(self, metrics: dict[str, Any]) -> None:
        """A one-row ``wandb.Table`` (``lessmem.report.COLUMNS``), the memory-vs-accuracy
        scatter and the per-epoch accuracy figure, so runs of a sweep can be compared in the UI."""
        import tempfile

        import wandb

        from lessmem import reporting as report

        try:  # a table or figure must never fail a finished run
            row = report.row_from(self.cfg, metrics, name=self.run.name or metrics.get("compression"),
                                  base=Path(str(self.cfg.get("out_dir") or ".")))
            report.log_wandb(self.run, [row], key="tradeoff", pareto=False, image=False)
            with tempfile.TemporaryDirectory() as tmp:
                png = report.plot_accuracy_curves([row], Path(tmp) / "acc.png", title=str(row["map"]))
                self.run.log({"tradeoff/accuracy_curves": wandb.Image(str(png))})
        except Exception as e:
            print(f"lessmem: W&B trade-off table skipped: {type(e).__name__}: {e}")

    def table(self, key: str, records: list[dict[str, Any]]) -> None:
        import wandb

        if records:
            columns = list(records[0])
            self.run.log({key: wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in records])})

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def build_logger(log: LogSpec, config: dict[str, Any], out_dir: Path, resume: bool) -> Logger:
    """The run's tracker (``log.logger``); ``config`` is the whole resolved run config, logged as
    W&B config. On resume a W&B run continues under its id."""
    lcfg = log.logger
    name = lcfg.get("name", "disabled")
    if name == "wandb":
        if lcfg.get("mode") == "disabled":
            return Logger()
        id_file = out_dir / "wandb_id.txt"
        resume_id = id_file.read_text().strip() if resume and id_file.exists() else None
        logger = WandbLogger(config, lcfg, out_dir, resume_id)
        id_file.write_text(logger.id)
        return logger
    if name == "csv":
        return CsvLogger(out_dir)
    if name == "disabled":
        return Logger()
    raise ValueError(f"unknown logger {name!r}; available: wandb, csv, disabled")


def coverage_for_config(cfg: DictConfig, batch: int | None = None) -> CoverageReport:
    """Coverage of the configured model and compression map on a random input batch of the
    task's shape (saved bytes depend on shapes only, not on pixel values or token ids)."""
    task = task_of(cfg)
    torch.manual_seed(int(cfg.get("seed", 0)))
    model = model_spec(cfg.model).build().train()
    compress_model(model, resolve_compression(cfg.compression), compression_given(cfg.compression), str(cfg.model.name))
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


def epoch_line(record: dict[str, Any], epochs: int, ratio: float) -> str:
    """One line per epoch: loss, the task's validation metric, saved ratio, time."""
    metric = (f"val_top1 {record['val_top1']:.4f}" if "val_top1" in record
              else f"val_ppl {record['val_ppl']:.3f}")
    return (f"epoch {record['epoch']}/{epochs}: train_loss {record['train_loss']:.4f}, {metric}, "
            f"val_loss {record['val_loss']:.4f}, saved ratio {ratio:.3f}, {record['epoch_time_s']:.1f}s")
