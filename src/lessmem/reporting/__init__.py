"""Tables, plots and W&B views of what runs and searches wrote (reads JSON/CSV/YAML; never trains).

One row per configuration (``rows.COLUMNS``) from a run or sweep directory (``runs``) or a
``lessmem.search`` directory (``searches``), used for the markdown/CSV tables, the PNGs and the
W&B ``Table``. The CLI scripts live in ``analysis/``.
"""

from lessmem.reporting.directory import report_dir
from lessmem.reporting.plots import (
    plot_accuracy_curves,
    plot_batch_plan,
    plot_per_layer,
    plot_ratio_bars,
    pyplot,
    save_figure,
)
from lessmem.reporting.rows import COLUMNS, MiB, kernel_summary, pareto_front, row_from
from lessmem.reporting.runs import load_runs
from lessmem.reporting.searches import load_search
from lessmem.reporting.sweep_callback import WandbSweepCallback
from lessmem.reporting.tables import markdown_table, read_memory_csv
from lessmem.reporting.wandb_report import log_dir_to_wandb, log_wandb

__all__ = [
    "COLUMNS",
    "MiB",
    "WandbSweepCallback",
    "kernel_summary",
    "load_runs",
    "load_search",
    "log_dir_to_wandb",
    "log_wandb",
    "markdown_table",
    "pareto_front",
    "plot_accuracy_curves",
    "plot_batch_plan",
    "plot_per_layer",
    "plot_ratio_bars",
    "pyplot",
    "read_memory_csv",
    "report_dir",
    "row_from",
    "save_figure",
]
