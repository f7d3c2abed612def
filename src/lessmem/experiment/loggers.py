"""Experiment trackers behind one small interface: W&B (offline/online), CSV, or nothing."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


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
    def __init__(self, cfg: DictConfig, lcfg: DictConfig, out_dir: Path, resume_id: str | None) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.cfg = OmegaConf.to_container(cfg, resolve=True)
        self.run = wandb.init(
            project=lcfg.get("project", "lessmem"),
            entity=lcfg.get("entity"),
            group=lcfg.get("group"),
            name=lcfg.get("run_name"),
            tags=list(lcfg.get("tags") or []),
            mode=lcfg.get("mode", "offline"),
            config=OmegaConf.to_container(cfg, resolve=True),
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


def build_logger(cfg: DictConfig, out_dir: Path) -> Logger:
    """``cfg`` is the whole run config (logged as W&B config); the tracker comes from ``cfg.logger``."""
    lcfg = cfg.get("logger") or {}
    name = lcfg.get("name", "disabled")
    if name == "wandb":
        if lcfg.get("mode") == "disabled":
            return Logger()
        id_file = out_dir / "wandb_id.txt"
        resume_id = id_file.read_text().strip() if cfg.get("resume") and id_file.exists() else None
        logger = WandbLogger(cfg, lcfg, out_dir, resume_id)
        id_file.write_text(logger.id)
        return logger
    if name == "csv":
        return CsvLogger(out_dir)
    if name == "disabled":
        return Logger()
    raise ValueError(f"unknown logger {name!r}; available: wandb, csv, disabled")
