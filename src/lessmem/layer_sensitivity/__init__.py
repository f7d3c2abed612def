"""Layer sensitivity: how much each layer's weight gradient changes under each compression
choice, measured from one stock forward/backward per batch, and the maps chosen from it
(torch only)."""

from lessmem.layer_sensitivity.geometry import conv_layers
from lessmem.layer_sensitivity.groups import group_layers
from lessmem.layer_sensitivity.io import append_history, write_map_yaml
from lessmem.layer_sensitivity.measure import DEFAULT_KERNELS, sensitivity
from lessmem.layer_sensitivity.result import SensitivityResult

__all__ = [
    "DEFAULT_KERNELS",
    "SensitivityResult",
    "append_history",
    "conv_layers",
    "group_layers",
    "sensitivity",
    "write_map_yaml",
]
