"""Layer sensitivity: what every compression choice (pooling kernel x storage of a layer's input,
storage of a BatchNorm or activation input) costs in bytes and in gradient error, measured from a
few stock forward/backward passes (``measure_menu``), and the maps chosen from it by a knapsack
(``MenuResult.make_map``). ``MenuOptions``: what a menu offers (``kernel_only()``: native storage alone). ``fit``: the map whose
whole training step fits a memory budget in bytes. Torch only."""

from lessmem.sensitivity.budget_plan import PlanRow, plan_batches
from lessmem.sensitivity.byte_sizes import format_bytes, parse_bytes
from lessmem.sensitivity.fit import (
    FIDELITIES,
    BudgetFit,
    NoFit,
    budget_profile,
    fit,
    step_time_ratio,
)
from lessmem.sensitivity.items import JOINT_KIND, MAP_KINDS, MenuItem, joint_option, option_name
from lessmem.sensitivity.menu import CRITERIA, DEFAULT_CRITERION, MenuResult, ScoredPlan
from lessmem.sensitivity.menu_measure import measure_menu
from lessmem.sensitivity.menu_options import DEFAULT_KERNELS, LOSSY_STORAGES, MenuOptions

__all__ = [
    "BudgetFit",
    "FIDELITIES",
    "NoFit",
    "PlanRow",
    "budget_profile",
    "fit",
    "format_bytes",
    "parse_bytes",
    "plan_batches",
    "step_time_ratio",
    "CRITERIA",
    "DEFAULT_CRITERION",
    "DEFAULT_KERNELS",
    "JOINT_KIND",
    "LOSSY_STORAGES",
    "MAP_KINDS",
    "MenuItem",
    "MenuOptions",
    "MenuResult",
    "joint_option",
    "measure_menu",
    "option_name",
    "ScoredPlan",
]
