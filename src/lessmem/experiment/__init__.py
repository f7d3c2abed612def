"""The experiment framework: a composed Hydra config in, a trained and measured run out
(``run``). Importing it makes the configs' resolvers (``${lessmem.data_root:NAME}``) available."""

from lessmem.experiment.budget import plan_for_config, step_timer
from lessmem.experiment.checkpoint import Interrupted, load_checkpoint
from lessmem.experiment.data import fixed_batches
from lessmem.experiment.loggers import coverage_for_config, save_report
from lessmem.experiment.paths import (
    compose_config,
    conf_dir,
    default_data_root,
    register_config_resolvers,
    resolve_path,
)
from lessmem.experiment.progress import on_terminal, with_progress
from lessmem.experiment.spec import model_spec
from lessmem.experiment.task import task_of
from lessmem.experiment.train import run

register_config_resolvers()

__all__ = [
    "Interrupted",
    "compose_config",
    "conf_dir",
    "coverage_for_config",
    "default_data_root",
    "fixed_batches",
    "load_checkpoint",
    "model_spec",
    "on_terminal",
    "plan_for_config",
    "resolve_path",
    "run",
    "save_report",
    "step_timer",
    "task_of",
    "with_progress",
]
