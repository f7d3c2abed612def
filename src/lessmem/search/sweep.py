"""The sweep file: its keys and defaults (``DEFAULTS``), loading and validation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lessmem.sensitivity import CRITERIA, DEFAULT_CRITERION

DEFAULTS: dict[str, Any] = {
    "study_name": "lessmem_search",
    "objective": "fidelity",        # fidelity | accuracy
    # kernels: one pooling kernel per layer or group (conv inputs only); menu: per-unit weights on
    # the menu knapsack's criterion (conv pooling x storage, BatchNorm / activation storages), needs
    # ``menu`` (a menu.json of lessmem-sensitivity sensitivity.menu=true), objective=accuracy, mode=budget.
    "space": "kernels",
    "menu": None,
    "criterion": DEFAULT_CRITERION,  # space=menu: what the knapsack minimizes
    "mode": "pareto",               # pareto: NSGA-II on (bytes, score) | budget: max score s.t. bytes
    "n_trials": 50,
    "seed": 0,
    "kernels": [1, 2, 4, 8],
    "groups": None,                 # fnmatch patterns, one kernel per pattern; None: per layer
    "budget": 0.25,                 # mode=budget: fraction of all-k=1 conv-input bytes (bytes if > 1)
    "population_size": 20,          # NSGA-II
    "seed_sensitivity_budget": 0.25,  # budget of the greedy sensitivity map enqueued as a seed
    "out_dir": "outputs/search/${study_name}",
    "storage": "${out_dir}/study.journal",
    "base_overrides": ["logger=disabled"],
    "score_key": "best_top1",       # accuracy: which metrics.json entry is the score
    "sensitivity": {"batches": 4, "batch_size": 32, "split": "train", "checkpoint": None},
    # Accuracy searches in budget mode: stop poor trials early from their per-epoch val_top1.
    # name: none | median | hyperband (Optuna prunes single-objective studies only).
    "pruner": {"name": "none", "n_startup_trials": 4, "n_warmup_steps": 1,
               "min_resource": 1, "reduction_factor": 3},
    # Shared studies (--worker): RDB heartbeat / stale grace and retries of killed trials;
    # poll_s: how often a worker waits for the last trials other workers are running.
    "heartbeat_s": 60,
    "grace_s": 180,
    "max_retry": 2,
    "poll_s": 5.0,
}

PRUNERS = ("none", "median", "hyperband")


def load_sweep(path: str | Path | None, overrides: Sequence[str] = ()) -> DictConfig:
    """DEFAULTS <- sweep YAML <- ``key=value`` overrides; interpolations resolved."""
    cfg = OmegaConf.create(DEFAULTS)
    if path is not None:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    unknown = set(cfg) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown sweep keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    if cfg.objective not in ("fidelity", "accuracy"):
        raise ValueError(f"objective must be 'fidelity' or 'accuracy', got {cfg.objective!r}")
    if cfg.mode not in ("pareto", "budget"):
        raise ValueError(f"mode must be 'pareto' or 'budget', got {cfg.mode!r}")
    if cfg.space not in ("kernels", "menu"):
        raise ValueError(f"space must be 'kernels' or 'menu', got {cfg.space!r}")
    if cfg.space == "menu":
        if cfg.objective != "accuracy" or cfg.mode != "budget":
            raise ValueError("space=menu needs objective=accuracy and mode=budget (the knapsack already "
                             "gives the map of best criterion; the search trains its variations at one budget)")
        if not cfg.menu or not Path(str(cfg.menu)).exists():
            raise FileNotFoundError(f"space=menu needs menu=<menu.json of lessmem-sensitivity sensitivity.menu=true>; "
                                    f"got {cfg.menu!r}")
        if cfg.criterion not in CRITERIA:
            raise ValueError(f"criterion must be one of {', '.join(CRITERIA)}, got {cfg.criterion!r}")
        if not 0 < float(cfg.budget) <= 1:
            raise ValueError(f"space=menu: budget is a fraction of stock saved bytes in (0, 1], got {cfg.budget}")
    pruner = str(cfg.pruner.name)
    if pruner not in PRUNERS:
        raise ValueError(f"pruner.name must be one of {list(PRUNERS)}, got {pruner!r}")
    if pruner != "none" and (cfg.mode != "budget" or cfg.objective != "accuracy"):
        raise ValueError("pruning needs objective=accuracy and mode=budget (Optuna cannot prune "
                         "multi-objective studies, and fidelity trials have no epochs)")
    OmegaConf.resolve(cfg)
    return cfg
