"""Optuna searches over per-layer compression maps: resumable, shared by many workers."""

from lessmem.search.search import (
    fail_dead_trials,
    load_sweep,
    make_pruner,
    make_storage,
    open_study,
    run_search,
)

__all__ = ["fail_dead_trials", "load_sweep", "make_pruner", "make_storage", "open_study", "run_search"]
