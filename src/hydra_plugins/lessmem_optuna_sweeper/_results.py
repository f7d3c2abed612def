"""``optimization_results.yaml`` in the sweep dir: the best trial, or the Pareto front."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import optuna
from hydra.errors import HydraException
from omegaconf import OmegaConf
from optuna.trial import FrozenTrial, TrialState

from hydra_plugins.lessmem_optuna_sweeper._settings import SweepSettings
from hydra_plugins.lessmem_optuna_sweeper._study import OUTPUT_DIR_ATTR

log = logging.getLogger(__name__)


def write_results(study: optuna.Study, settings: SweepSettings, path: Path) -> None:
    """Best params and value (one objective) or every Pareto-optimal trial's params and values,
    with each trial's number and run dir. Raises HydraException when no trial completed."""
    states = [t.state for t in study.get_trials(deepcopy=False)]
    results: dict[str, Any] = {
        "name": "lessmem_optuna", "study_name": study.study_name,
        "objectives": list(settings.objectives), "directions": list(settings.directions),
        "n_complete": states.count(TrialState.COMPLETE), "n_failed": states.count(TrialState.FAIL),
    }
    if not results["n_complete"]:
        raise HydraException(f"Study {study.study_name}: no trial completed "
                             f"({results['n_failed']} failed: see the log)")
    if settings.multi_objective:
        results["solutions"] = [_solution(t) for t in study.best_trials]
        log.info("Pareto front: %d trials", len(results["solutions"]))
    else:
        best = study.best_trial
        results.update(best_params=best.params, best_value=best.value, best_trial=best.number,
                       best_output_dir=best.user_attrs.get(OUTPUT_DIR_ATTR))
        log.info("Best value %s with %s", best.value, best.params)
    OmegaConf.save(OmegaConf.create(results), path)


def _solution(trial: FrozenTrial) -> dict[str, Any]:
    return {"trial": trial.number, "params": trial.params, "values": trial.values,
            "output_dir": trial.user_attrs.get(OUTPUT_DIR_ATTR)}
