"""Optuna searches over per-layer compression maps, resumable and shared by many workers, and
the menu measurement they start from.

    lessmem-search -cd sweeps -cn menu_resnet20 [key=value ...]

A search config (``conf/search.yaml``, extended by ``sweeps/*.yaml``) names the menu (a file of
``lessmem-sensitivity``, or measured once for the study: ``menu_file``), the budget and the
training of each trial; trials are the menu knapsack's maps under per-unit weights (``objective``).
The study lives in a journal file or an RDB (``storage``, ``study``: the Optuna layer the Hydra
sweeper shares) and is resumed by rerunning the same command (``run``); many workers can share it
(``workers``, docs/scale_out.md). Each search writes its report (``report``).
"""

from lessmem.search.menu_file import check_criterion, measure_config_menu, write_menu_files
from lessmem.search.run import run_search
from lessmem.search.storage import Heartbeat, make_storage
from lessmem.search.study import fail_interrupted, make_pruner, open_study
from lessmem.search.workers import fail_dead_trials

__all__ = [
    "Heartbeat",
    "check_criterion",
    "fail_dead_trials",
    "fail_interrupted",
    "make_pruner",
    "make_storage",
    "measure_config_menu",
    "open_study",
    "run_search",
    "write_menu_files",
]
