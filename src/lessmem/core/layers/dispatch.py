"""How a swapped layer's forward picks its path: stock when nothing will be saved, one dtype as
autocast would choose it, and eager (with one warning) where torch.compile has no kernel."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

_warned: set[str] = set()
# Where ``compress`` keeps a swapped module's own class (``uncompress`` restores it).
ORIGINAL_CLASS_ATTR = "_lessmem_original_class"


def needs_saving(x: Tensor, module: nn.Module) -> bool:
    """Whether autograd will keep anything: under no_grad / inference the stock path runs, no overhead."""
    return torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for p in module.parameters(recurse=False))
    )


def autocast_cast(x: Tensor, weight: Tensor, bias: Tensor | None):
    """Cast like autocast would for conv/linear, so the Function then runs in a single dtype."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def warn_eager(module: nn.Module, what: str) -> None:
    """Say once per layer that a part without a compiled kernel runs eagerly (a graph break)."""
    name = getattr(module, "lessmem_name", type(module).__name__)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"lessmem: layer {name!r} ({what}) has no compiled kernel on torch "
            f"{torch.__version__}; it runs eagerly under torch.compile (graph break)",
            stacklevel=3,
        )
