"""A study's finished trials as flat rows (what ``trials.csv`` and the report hold)."""

from __future__ import annotations

import json
from typing import Any

import optuna


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """Complete trials with their score; these alone enter the Pareto front."""
    rows = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        a = t.user_attrs
        rows.append({"trial": t.number, "seed": a.get("seed", ""), "conv_input_bytes": a["conv_input_bytes"],
                     "state": "complete", "pruned_at_epoch": "",
                     "score": a["score"], "mean_cosine": a["mean_cosine"],
                     "feasible": all(c <= 0 for c in a.get("constraint", [0.0])),
                     "params": _params(t), "config": a.get("config", ""), "map": a["map"],
                     "rerun": a.get("rerun", "")})
    return rows


def pruned_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """Pruned trials: ``score`` is their last reported value, at epoch ``pruned_at_epoch``."""
    rows = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.PRUNED,)):
        a = t.user_attrs
        last, value = last_report(t)
        rows.append({"trial": t.number, "seed": a.get("seed", ""), "conv_input_bytes": a.get("conv_input_bytes", ""),
                     "state": "pruned", "pruned_at_epoch": last if last is not None else "",
                     "score": value if value is not None else "", "mean_cosine": a.get("mean_cosine", ""),
                     "feasible": all(c <= 0 for c in a.get("constraint", [0.0])),
                     "params": _params(t), "config": a.get("config", ""), "map": a.get("map", {}),
                     "rerun": a.get("rerun", "")})
    return rows


def last_report(t: optuna.trial.FrozenTrial) -> tuple[int | None, float | None]:
    """(epoch, value) of the trial's last intermediate report; (None, None) before any."""
    steps = t.intermediate_values
    if not steps:
        return None, None
    last = max(steps)
    return last, steps[last]


def _params(t: optuna.trial.FrozenTrial) -> str:
    """The trial's kernels as JSON, unit -> kernel (without the ``k:`` parameter prefix)."""
    return json.dumps({k.removeprefix("k:"): v for k, v in t.params.items()})
