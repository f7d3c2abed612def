"""The Hydra ``Sweeper`` plugin: settings in, trials out through the configured launcher."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from hydra_plugins.lessmem_optuna_sweeper._settings import SweepSettings


class LessmemOptunaSweeper(Sweeper):
    """Optuna asks for trials in batches of ``n_jobs``, the launcher runs them as Hydra jobs,
    their return values are told back; see ``config.LessmemOptunaSweeperConf`` for the keys."""

    def __init__(self, *, n_trials: int, n_jobs: int, sampler: str, seed: int | None,
                 direction: str, directions: Sequence[str] | None, objectives: Sequence[str],
                 storage: str | None, study_name: str | None,
                 params: Mapping[str, object] | None) -> None:
        self.settings = SweepSettings.from_config(
            n_trials=n_trials, n_jobs=n_jobs, sampler=sampler, seed=seed, direction=direction,
            directions=directions, objectives=objectives, storage=storage,
            study_name=study_name, params=params)
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        # Optuna loads only when sweeping: Hydra imports this module on every start.
        from hydra_plugins.lessmem_optuna_sweeper._optimize import optimize

        assert self.config is not None and self.hydra_context is not None and self.launcher is not None
        optimize(self.settings, [*self.settings.params, *arguments], config=self.config,
                 config_loader=self.hydra_context.config_loader, launcher=self.launcher,
                 validate=self.validate_batch_is_legal)
