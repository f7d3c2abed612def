"""The Optuna study behind a sweep: sampler, storage, resuming, and telling trial outcomes."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import optuna
from optuna.samplers import BaseSampler, GridSampler, RandomSampler, TPESampler
from optuna.trial import Trial, TrialState

from hydra_plugins.lessmem_optuna_sweeper._search_space import SearchSpace
from hydra_plugins.lessmem_optuna_sweeper._settings import SweepSettings
from lessmem.search import study as study_layer
from lessmem.search.storage import make_storage

log = logging.getLogger(__name__)

ERROR_ATTR = "error"  # user attr of a trial whose task failed: "<exception type>: <message>"
OUTPUT_DIR_ATTR = "output_dir"  # user attr: the trial's Hydra job output dir


def make_sampler(name: str, seed: int | None, space: SearchSpace) -> BaseSampler:
    if name == "grid":
        return GridSampler(space.grid(), seed=seed)
    if name == "random":
        return RandomSampler(seed=seed)
    return TPESampler(seed=seed)


def open_study(settings: SweepSettings, sampler: BaseSampler) -> optuna.Study:
    """Creates the study or resumes it (same storage and study_name), trials an interrupted sweep
    left running queued again (``lessmem.search``'s study layer). One sweep per study at a time:
    a RUNNING trial is taken to be a dead one."""
    study, _ = study_layer.open_study(settings.study_name, make_storage(settings.storage), sampler,
                                      settings.directions)
    for number in study_layer.fail_interrupted(study):
        log.info("Trial %d was interrupted: queued again", number)
    return study


def n_done(study: optuna.Study) -> int:
    """Trials that count towards n_trials: completed, or failed by their task (not the
    interrupted ones, which run again)."""
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state == TrialState.COMPLETE
               or (t.state == TrialState.FAIL and ERROR_ATTR in t.user_attrs))


def fail(study: optuna.Study, trial: Trial, error: BaseException) -> None:
    trial.set_user_attr(ERROR_ATTR, f"{type(error).__name__}: {error}")
    log.warning("Trial %d failed: %s: %s", trial.number, type(error).__name__, error)
    tell(study, trial, TrialState.FAIL)


def tell(study: optuna.Study, trial: Trial | int, state: TrialState,
         values: Sequence[float] | None = None) -> None:
    try:
        study.tell(trial, values=values, state=state)
    except RuntimeError as e:
        # GridSampler stops the study once its grid is used up, which raises outside
        # Study.optimize; the trial's outcome is stored before that.
        if not isinstance(study.sampler, GridSampler) or "Study.stop" not in str(e):
            raise
