"""Optuna searches over per-layer (or per-group) compression maps: resumable, shared by many workers.

    lessmem-search --config sweeps/fidelity_resnet18_cifar.yaml [key=value ...]

A sweep file (``sweep``) names the objective (``objective``: gradient fidelity or trained
accuracy, both against conv-input bytes), the study lives in a journal file or an RDB
(``storage``, ``study``) and is resumed by rerunning the same command (``run``); many workers
can share it (``workers``, docs/scale_out.md). Each search writes its report (``report``).
"""

from lessmem.search.run import run_search
from lessmem.search.storage import make_storage
from lessmem.search.study import make_pruner, open_study
from lessmem.search.sweep import DEFAULTS, load_sweep
from lessmem.search.workers import fail_dead_trials

__all__ = [
    "DEFAULTS",
    "fail_dead_trials",
    "load_sweep",
    "make_pruner",
    "make_storage",
    "open_study",
    "run_search",
]
