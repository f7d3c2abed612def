"""The sweep loop: ask a batch of trials, launch them as Hydra jobs, tell their outcomes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import optuna
from hydra.core.config_loader import ConfigLoader
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, OmegaConf
from optuna.trial import Trial, TrialState

from hydra_plugins.lessmem_optuna_sweeper._objectives import objective_values
from hydra_plugins.lessmem_optuna_sweeper._results import write_results
from hydra_plugins.lessmem_optuna_sweeper._search_space import parse_search_space
from hydra_plugins.lessmem_optuna_sweeper._settings import SweepSettings
from hydra_plugins.lessmem_optuna_sweeper._study import (
    OUTPUT_DIR_ATTR,
    fail,
    make_sampler,
    n_done,
    open_study,
    tell,
)

log = logging.getLogger(__name__)


def optimize(settings: SweepSettings, overrides: Sequence[str], *, config: DictConfig,
             config_loader: ConfigLoader, launcher: Launcher,
             validate: Callable[[Sequence[Sequence[str]]], None]) -> None:
    """Runs trials until the study holds ``n_trials`` done ones (capped at the grid's size),
    ``n_jobs`` at a time; a trial whose task raises is marked FAIL and the sweep goes on. Then
    writes ``optimization_results.yaml`` in the sweep dir."""
    sweep_dir = Path(config.hydra.sweep.dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, sweep_dir / "multirun.yaml")
    space = parse_search_space(overrides, config_loader, grid=settings.sampler == "grid")
    n_trials = settings.n_trials
    if settings.sampler == "grid":
        n_trials = min(n_trials, space.grid_size())
    study = open_study(settings, make_sampler(settings.sampler, settings.seed, space))
    log.info("Study %s (%s sampler, %s, storage %s): %d of %d trials done", study.study_name,
             settings.sampler, "/".join(settings.directions), settings.storage or "in memory",
             n_done(study), n_trials)
    while (left := n_trials - n_done(study)) > 0:
        trials = [study.ask(space.distributions) for _ in range(min(settings.n_jobs, left))]
        batch = [space.overrides(trial.params) for trial in trials]
        try:
            validate(batch)
        except Exception:
            # A config that cannot compose is the sweep's error, not the trials': they fail
            # without counting towards n_trials.
            for trial in trials:
                tell(study, trial, TrialState.FAIL)
            raise
        returns = launcher.launch(batch, initial_job_idx=trials[0].number)
        for trial, job in zip(trials, returns, strict=True):
            _record(study, trial, job, settings.objectives)
    write_results(study, settings, sweep_dir / "optimization_results.yaml")


def _record(study: optuna.Study, trial: Trial, job: JobReturn, objectives: Sequence[str]) -> None:
    if job.hydra_cfg is not None:
        trial.set_user_attr(OUTPUT_DIR_ATTR, job.hydra_cfg.hydra.runtime.output_dir)
    try:
        values = objective_values(job.return_value, objectives)  # re-raises the task's error
    except Exception as e:
        fail(study, trial, e)
        return
    tell(study, trial, TrialState.COMPLETE, values)
