"""Layer sensitivity: how much each layer's weight gradient changes under each compression
choice, measured from one stock forward/backward per batch, and the maps chosen from it
(torch only)."""

from lessmem.layer_sensitivity.sensitivity import (
    DEFAULT_KERNELS,
    SensitivityResult,
    append_history,
    conv_layers,
    group_layers,
    sensitivity,
    write_map_yaml,
)

__all__ = [
    "DEFAULT_KERNELS",
    "SensitivityResult",
    "append_history",
    "conv_layers",
    "group_layers",
    "sensitivity",
    "write_map_yaml",
]
