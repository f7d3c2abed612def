"""Opening an Optuna study, for ``lessmem-search`` and the Hydra sweeper alike: created or resumed
(same storage and name), trials an interrupted run left RUNNING queued again, the pruner of a
search's settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.trial import TrialState

# User attrs a queued-again trial keeps (its label among the seeded trials).
KEPT_ATTRS = ("seed",)


def open_study(name: str | None, storage: BaseStorage | None, sampler: optuna.samplers.BaseSampler,
               directions: Sequence[str], pruner: optuna.pruners.BasePruner | None = None
               ) -> tuple[optuna.Study, bool]:
    """(study, created here): created, or loaded when ``storage`` already holds ``name``."""
    try:
        return optuna.create_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner,
                                   directions=list(directions)), True
    except optuna.exceptions.DuplicatedStudyError:
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner), False


def n_stored(storage: BaseStorage | None, name: str) -> int:
    """Trials already stored under ``name`` (0 for a new study): a resumed study offsets its
    sampler seed by it, so it does not replay the first proposals."""
    if storage is None:
        return 0
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return 0
    return len(storage.get_all_trials(study_id, deepcopy=False))


def requeue(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Queue a trial's params again (a stale or dropped trial did not finish: not a repeat)."""
    attrs = {k: v for k, v in trial.user_attrs.items() if k in KEPT_ATTRS}
    study.enqueue_trial(trial.params, user_attrs={**attrs, "retry_of": trial.number})


def fail_interrupted(study: optuna.Study) -> list[int]:
    """Trials left RUNNING by an interrupted process: mark them failed and queue them again.
    Assumes one process per study (workers: ``lessmem.search.workers.fail_dead_trials``)."""
    stale = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in stale:
        study.tell(t.number, state=TrialState.FAIL)
        requeue(study, t)
    return [t.number for t in stale]


def make_pruner(pcfg: Mapping[str, Any]) -> optuna.pruners.BasePruner:
    """A search's pruner; one step is one training epoch (Hyperband's maximum: the epochs of the
    first trial that completes)."""
    name = str(pcfg["name"])
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=int(pcfg["n_startup_trials"]),
                                           n_warmup_steps=int(pcfg["n_warmup_steps"]))
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=int(pcfg["min_resource"]), max_resource="auto",
                                              reduction_factor=int(pcfg["reduction_factor"]))
    return optuna.pruners.NopPruner()


def n_finished(study: optuna.Study) -> int:
    """Complete and pruned trials: what a search's ``n_trials`` counts."""
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
