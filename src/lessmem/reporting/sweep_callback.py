"""A Hydra callback that reports a multirun when it ends: W&B views and ``<sweep>/report/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from lessmem.reporting.directory import report_dir
from lessmem.reporting.runs import load_runs
from lessmem.reporting.wandb_report import log_dir_to_wandb


class WandbSweepCallback(Callback):
    """After a multirun, log the sweep's table and plots to W&B (offline) and write its report.

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
