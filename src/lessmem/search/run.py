"""``run_search``: create or resume a study, run the trials still missing, write the report."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf

from lessmem.experiment import compose_config
from lessmem.sensitivity import MenuResult
from lessmem.search.menu_objective import MenuObjective
from lessmem.search.menu_report import write_menu_report
from lessmem.search.objective import Objective, param_name, seed_maps
from lessmem.search.report import write_report
from lessmem.search.sensitivity_cache import study_sensitivity
from lessmem.search.study import n_finished, open_or_create_study
from lessmem.search.workers import fail_dead_trials, fail_stale, file_lock, optimize_shared

log = logging.getLogger(__name__)


def run_search(sweep: DictConfig, worker: bool = False) -> dict[str, Any]:
    """Create or resume the study, run the missing trials, write the report; returns a summary.

    Rerunning the same sweep resumes it (``n_trials`` counts complete + pruned trials).
    ``worker``: one of several processes sharing the study, on any hosts that reach its storage;
    together they finish exactly ``n_trials`` (see ``lessmem.search.workers``)."""
    out_dir = Path(sweep.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(sweep, out_dir / "sweep.yaml")
    base = compose_config(list(sweep.base_overrides))
    objective: Objective | MenuObjective
    if sweep.space == "menu":
        objective = MenuObjective(sweep, base, MenuResult.load(sweep.menu), out_dir)
        seeds = objective.seeds()

        def report(study: optuna.Study) -> dict[str, Any]:
            return write_menu_report(study, sweep, out_dir)
    else:
        result = study_sensitivity(sweep, base, out_dir)
        objective = Objective(sweep, base, result, out_dir)
        seeds = {label: {param_name(u): k for u, k in params.items()}
                 for label, params in seed_maps(result, objective.units, sweep).items()}

        def report(study: optuna.Study) -> dict[str, Any]:
            return write_report(study, result, sweep, out_dir)
    study, created = open_or_create_study(sweep, sweep.storage, worker)
    stale = fail_dead_trials(study, float(sweep.grace_s)) if worker else fail_stale(study)
    if (created if worker else not study.trials):  # workers: only the one that created the study
        for label, params in seeds.items():
            study.enqueue_trial(params, user_attrs={"seed": label})
    remaining = int(sweep.n_trials) - n_finished(study)
    log.info("study %s: %d finished, running %d more%s", sweep.study_name, n_finished(study),
             max(remaining, 0), f" (failed stale trials {stale})" if stale else "")
    if worker:
        optimize_shared(study, objective, sweep, catch=(RuntimeError, ValueError))
        with file_lock(out_dir / ".report.lock"):  # workers finishing together
            return report(study)
    if remaining > 0:
        study.optimize(objective, n_trials=remaining, catch=(RuntimeError, ValueError),
                       show_progress_bar=sys.stderr.isatty())
    return report(study)
