"""``run_search``: create or resume a study, run the trials still missing, write the report."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf

from lessmem.experiment import compose_config, on_terminal
from lessmem.search.menu_file import cached_menu, check_criterion
from lessmem.search.objective import Objective
from lessmem.search.report import write_report
from lessmem.search.storage import Heartbeat, make_storage
from lessmem.search.study import fail_interrupted, make_pruner, n_finished, n_stored, open_study
from lessmem.search.workers import fail_dead_trials, file_lock, optimize_shared
from lessmem.sensitivity import MenuResult

log = logging.getLogger(__name__)

PRUNERS = ("none", "median", "hyperband")


def check_search(search: DictConfig) -> None:
    """ValueError for settings no search can run with, before anything is measured or trained."""
    check_criterion(str(search.criterion))
    if not 0 < float(search.budget) <= 1:
        raise ValueError(f"budget is a fraction of stock saved bytes in (0, 1], got {search.budget}")
    if int(search.n_trials) < 1:
        raise ValueError(f"n_trials must be at least 1, got {search.n_trials}")
    if str(search.pruner.name) not in PRUNERS:
        raise ValueError(f"pruner.name must be one of {list(PRUNERS)}, got {search.pruner.name!r}")
    if search.menu_file and not Path(str(search.menu_file)).exists():
        raise FileNotFoundError(f"menu_file {search.menu_file} does not exist (lessmem-sensitivity writes one)")


def open_search_study(search: DictConfig) -> tuple[optuna.Study, bool]:
    """(study, created here): TPE seeded by ``search.seed`` plus the trials already stored (a
    resumed study must not replay the first proposals) and, for a worker, its host and pid
    (workers started together would otherwise propose the same maps)."""
    storage = make_storage(str(search.storage), Heartbeat(int(search.heartbeat_s), int(search.grace_s),
                                                          int(search.max_retry)))
    seed = int(search.seed) + n_stored(storage, str(search.study_name))
    if search.worker:
        seed += (hash(socket.gethostname()) + 7919 * os.getpid()) % 1_000_003
    return open_study(str(search.study_name), storage, optuna.samplers.TPESampler(seed=seed), [str(search.direction)],
                      make_pruner(search.pruner))


def run_search(search: DictConfig) -> dict[str, Any]:
    """Create or resume the study, run the missing trials, write the report; returns its summary.

    Rerunning the same search resumes it (``n_trials`` counts complete + pruned trials).
    ``search.worker``: one of several processes sharing the study, on any hosts that reach its
    storage; together they finish exactly ``n_trials`` (``lessmem.search.workers``)."""
    check_search(search)
    out_dir = Path(search.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(search, out_dir / "search.yaml", resolve=True)
    base = compose_config(list(search.base_overrides))
    menu = (MenuResult.load(str(search.menu_file)) if search.menu_file
            else cached_menu(base, search.menu, search.sensitivity, out_dir / "menu"))
    menu.make_map(float(search.budget), str(search.criterion))  # a budget no map fits: one error, not failed trials
    objective = Objective(search, base, menu)
    study, created = open_search_study(search)
    stale = fail_dead_trials(study, float(search.grace_s)) if search.worker else fail_interrupted(study)
    if (created if search.worker else not study.trials):  # workers: only the one that created the study
        for label, params in objective.seeds().items():
            study.enqueue_trial(params, user_attrs={"seed": label})
    remaining = int(search.n_trials) - n_finished(study)
    log.info("study %s: %d finished, running %d more%s", search.study_name, n_finished(study),
             max(remaining, 0), f" (failed stale trials {stale})" if stale else "")
    if search.worker:
        optimize_shared(study, objective, search, catch=(RuntimeError, ValueError))
        with file_lock(out_dir / ".report.lock"):  # workers finishing together
            return write_report(study, search)
    if remaining > 0:
        study.optimize(objective, n_trials=remaining, catch=(RuntimeError, ValueError),
                       show_progress_bar=on_terminal())
    return write_report(study, search)
