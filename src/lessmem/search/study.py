"""Opening a study: created or resumed, with the sweep's sampler and pruner."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig

from lessmem.search.storage import make_storage


def make_pruner(pcfg: Mapping[str, Any]) -> optuna.pruners.BasePruner:
    """The sweep's pruner; one step is one training epoch (Hyperband's maximum: the epochs of
    the first trial that completes)."""
    name = str(pcfg["name"])
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=int(pcfg["n_startup_trials"]),
                                           n_warmup_steps=int(pcfg["n_warmup_steps"]))
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=int(pcfg["min_resource"]),
                                              max_resource="auto",
                                              reduction_factor=int(pcfg["reduction_factor"]))
    return optuna.pruners.NopPruner()


def open_study(sweep: DictConfig, storage_path: str | Path, worker: bool = False) -> optuna.Study:
    return open_or_create_study(sweep, storage_path, worker)[0]


def open_or_create_study(sweep: DictConfig, storage_path: str | Path,
                         worker: bool = False) -> tuple[optuna.Study, bool]:
    """(study, created here)."""
    storage = make_storage(sweep, storage_path)
    # Offset the sampler seed by the trials already stored: a resumed study must not replay the
    # first generation's random proposals. Workers also differ by host and pid: workers started
    # together would otherwise propose the same maps.
    existing = _n_existing(storage, sweep.study_name)
    seed = int(sweep.seed) + existing
    if worker:
        seed += (hash(socket.gethostname()) + 7919 * os.getpid()) % 1_000_003
    if sweep.mode == "pareto":
        sampler: optuna.samplers.BaseSampler = optuna.samplers.NSGAIISampler(
            population_size=int(sweep.population_size), seed=seed)
        directions = ["minimize", "maximize"]
    else:
        # Constraint values come from trial.set_constraint (Optuna 5; constraints_func is deprecated).
        sampler = optuna.samplers.TPESampler(seed=seed)
        directions = ["maximize"]
    pruner = make_pruner(sweep.pruner)
    try:
        return optuna.create_study(study_name=sweep.study_name, storage=storage, sampler=sampler,
                                   pruner=pruner, directions=directions), True
    except optuna.exceptions.DuplicatedStudyError:
        return optuna.load_study(study_name=sweep.study_name, storage=storage, sampler=sampler,
                                 pruner=pruner), False


def _n_existing(storage: Any, name: str) -> int:
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return 0
    return len(storage.get_all_trials(study_id, deepcopy=False))


def n_finished(study: optuna.Study) -> int:
    """Complete and pruned trials: what ``n_trials`` counts."""
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=done))
