"""The exact path of ``lessmem.fit`` (``fidelity="exact"``): only options that keep stock's gradients
to float rounding, and the fastest such plan whose measured whole step fits the budget.

The plans, from fastest to smallest (each a real step on the batch when the search looks at it):

1. exact companions alone (1-bit ReLU masks, uint8 max-pool indices);
2. plus every conv that reads ReLU(BatchNorm) rebuilt from it (``from_bn``) and BatchNorm's chunked
   backward (``norm_storage="chunked"``);
3. plus regions recomputed in backward (``recompute``): the model's blocks, the one that saves the
   most bytes per second of rerun first (``region_costs``: bytes from a saved-tensor count with the
   region recomputed, seconds from its forward, both on a sub-batch); the k-th plan recomputes the
   first k.

The search takes the first plan that fits, bisecting over k (more regions: fewer bytes, more time);
the last plan is the exact floor: below it, ``NoFit`` names the floor and the largest batch that fits.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lessmem.core import CompressionPlan, compress, measure_memory, rebuildable_convs, uncompress
from lessmem.core.ops.registry import compressed_class_of

Peak = Callable[[CompressionPlan], int]  # a plan's measured whole-step peak on the batch


@dataclass(frozen=True)
class RegionCost:
    """What recomputing one region saves and costs, on the batch the search runs on."""

    name: str
    saved_bytes: int  # fewer bytes kept for backward than without it
    seconds: float  # its forward (the rerun's cost)

    @property
    def bytes_per_second(self) -> float:
        return self.saved_bytes / max(self.seconds, 1e-9)


def region_candidates(model: nn.Module) -> list[str]:
    """The model's blocks: modules with children that sit in an ``nn.Sequential`` or ``nn.ModuleList``
    (torchvision's ``layer1.0``, MobileNet's ``features.3``, HF's ``model.layers.0``), outermost only,
    and never a lone compressible layer (a conv or linear: its input is all it keeps anyway)."""
    found: list[str] = []
    for name, module in model.named_modules():
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model if name else None
        if parent is None or not isinstance(parent, (nn.Sequential, nn.ModuleList)):
            continue
        if not any(True for _ in module.children()) or compressed_class_of(module) is not None:
            continue
        if any(name.startswith(f"{f}.") for f in found):
            continue
        found.append(name)
    return found


def region_costs(model: nn.Module, inputs: Tensor, base: CompressionPlan, scale: float) -> list[RegionCost]:
    """Each candidate region's saved bytes (``scale`` times those on ``inputs``, a sub-batch) and
    forward seconds, with ``base`` applied around it; most bytes per second first."""
    net = copy.deepcopy(model).train()
    compress(net, base)
    base_bytes = measure_memory(net, inputs).total_bytes
    seconds = _forward_seconds(net, inputs, region_candidates(model))
    costs = []
    for name in region_candidates(model):
        compress(net, base.replace(recompute=(name,)))
        saved = base_bytes - measure_memory(net, inputs).total_bytes
        if saved > 0:
            costs.append(RegionCost(name, round(saved * scale), seconds[name] * scale))
    uncompress(net)
    return sorted(costs, key=lambda c: -c.bytes_per_second)


def _forward_seconds(model: nn.Module, inputs: Tensor, names: list[str]) -> dict[str, float]:
    """Each named module's forward time in a training-mode forward (the second of two)."""
    started: dict[str, float] = {}
    took: dict[str, float] = dict.fromkeys(names, 0.0)
    hooks = []
    for name in names:
        module = model.get_submodule(name)
        hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: started.__setitem__(n, time.perf_counter())))
        hooks.append(module.register_forward_hook(
            lambda m, a, o, n=name: took.__setitem__(n, time.perf_counter() - started[n])))
    try:
        for _ in range(2):
            with torch.enable_grad():
                model(inputs)
    finally:
        for h in hooks:
            h.remove()
    return took


def exact_plans(model: nn.Module, inputs: Tensor, scale: float) -> tuple[list[CompressionPlan], list[RegionCost]]:
    """The search's plans, fastest first (the module docstring), and the region costs behind them."""
    companions = CompressionPlan(exact_companions=True)
    rebuilt = CompressionPlan(dict.fromkeys(rebuildable_convs(model, inputs), "from_bn"), norm_storage="chunked",
                              exact_companions=True)
    costs = region_costs(model, inputs, rebuilt, scale)
    plans = [companions, rebuilt]
    plans += [rebuilt.replace(recompute=tuple(c.name for c in costs[:k])) for k in range(1, len(costs) + 1)]
    return plans, costs


def fastest_fitting(plans: list[CompressionPlan], peak: Peak, budget_bytes: int) -> tuple[int | None, dict[int, int]]:
    """The index of the first plan whose measured peak fits ``budget_bytes`` (None: not even the
    last) and every peak measured on the way, bisecting (later plans keep fewer bytes)."""
    measured: dict[int, int] = {}

    def fits(i: int) -> bool:
        if i not in measured:
            measured[i] = peak(plans[i])
        return measured[i] <= budget_bytes

    if not fits(len(plans) - 1):
        return None, measured
    lo, hi = 0, len(plans) - 1  # plans[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi, measured
