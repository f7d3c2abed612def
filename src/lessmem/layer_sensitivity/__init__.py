"""Layer sensitivity: how much each layer's weight gradient changes under each compression
choice, measured from one stock forward/backward per batch (kernels: ``sensitivity``; the whole
kernel x storage menu with the whole-gradient criterion: ``measure_menu``), and the maps chosen
from it (torch only); ``fit``: the map whose whole training step fits a memory budget in bytes."""

from lessmem.layer_sensitivity.budget_plan import PlanRow, plan_batches
from lessmem.layer_sensitivity.byte_sizes import format_bytes, parse_bytes
from lessmem.layer_sensitivity.fit import BudgetChoice, NoFit, budget_profile, fit
from lessmem.layer_sensitivity.geometry import conv_layers
from lessmem.layer_sensitivity.groups import group_layers
from lessmem.layer_sensitivity.io import append_history, read_map_yaml, write_map_yaml
from lessmem.layer_sensitivity.measure import DEFAULT_KERNELS, sensitivity
from lessmem.layer_sensitivity.menu import (
    CRITERIA,
    DEFAULT_CRITERION,
    MapChoice,
    MenuItem,
    MenuResult,
    option_name,
)
from lessmem.layer_sensitivity.menu_measure import LOSSY_STORAGES, measure_menu
from lessmem.layer_sensitivity.result import SensitivityResult

__all__ = [
    "BudgetChoice",
    "NoFit",
    "PlanRow",
    "budget_profile",
    "plan_batches",
    "fit",
    "format_bytes",
    "parse_bytes",
    "CRITERIA",
    "DEFAULT_CRITERION",
    "DEFAULT_KERNELS",
    "LOSSY_STORAGES",
    "MapChoice",
    "MenuItem",
    "MenuResult",
    "SensitivityResult",
    "append_history",
    "conv_layers",
    "group_layers",
    "measure_menu",
    "option_name",
    "read_map_yaml",
    "sensitivity",
    "write_map_yaml",
]
