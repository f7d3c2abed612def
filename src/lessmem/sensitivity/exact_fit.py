"""The exact path of ``lessmem.fit`` (``fidelity="exact"``): only options that keep stock's gradients
to float rounding, and the fastest such plan whose measured whole step fits the budget.

The plans, from fastest to smallest (each a real step on the batch when the search looks at it):

1. exact companions alone (1-bit ReLU masks, uint8 max-pool indices);
2. plus every conv that reads ReLU(BatchNorm) rebuilt from it (``from_bn``) and BatchNorm's chunked
   backward (``norm_storage="chunked"``);
3. plus regions recomputed in backward (``recompute``): the model's blocks and the runs of sibling
   layers between them (a ResNet's stem ``conv1+bn1+relu+maxpool``), the one that saves the most
   bytes per second of rerun first (``region_costs``: bytes from a saved-tensor count with the
   region recomputed, seconds from its forward, both on a sub-batch); the k-th plan recomputes the
   first k.

The search takes the first plan that fits, bisecting over k (more regions: fewer bytes, more time);
the last plan is the exact floor: below it, ``NoFit`` names the floor and the largest batch that fits.
Where every region recomputed with nothing else peaks lower than the last plan, the search runs
on that ladder instead (``bare_plans``: plain checkpointing of the first k regions).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lessmem.core import CompressionPlan, compress, measure_memory, rebuildable_convs, uncompress
from lessmem.core.ops.recomputed_region import RUN_JOIN, in_regions
from lessmem.core.ops.registry import compressed_class_of

TIMED_FORWARDS = 3
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


def run_candidates(model: nn.Module, inputs: Tensor) -> list[str]:
    """Runs of two or more sibling layers outside the blocks that a training-mode forward of
    ``inputs`` calls one after another, each on the one before's output (``"conv1+bn1+relu+maxpool"``)."""
    blocks = region_candidates(model)
    leaves = [(n, m) for n, m in model.named_modules()
              if n and not any(True for _ in m.children()) and not any(n.startswith(f"{b}.") for b in blocks)]
    calls: list[tuple[str, int, int]] = []  # (name, id of its one input, id of its output), in call order

    def called(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
            one = len(args) == 1 and not kwargs and isinstance(args[0], Tensor) and isinstance(out, Tensor)
            calls.append((name, id(args[0]) if one else -1, id(out) if one else -2))
        return record

    hooks = [m.register_forward_hook(called(n), with_kwargs=True) for n, m in leaves]
    try:
        with torch.enable_grad():
            model(inputs)
    finally:
        for h in hooks:
            h.remove()
    runs: list[list[str]] = []
    for i, (name, source, _) in enumerate(calls):
        before = calls[i - 1] if i else None
        joins = (before is not None and source >= 0 and before[2] == source and runs and runs[-1][-1] == before[0]
                 and name.rpartition(".")[0] == before[0].rpartition(".")[0])
        if joins:
            runs[-1].append(name)
        else:
            runs.append([name])
    return [RUN_JOIN.join(r) for r in runs if len(r) > 1 and len(set(r)) == len(r)]


def with_regions(sources: dict[str, str], regions: tuple[str, ...]) -> CompressionPlan:
    """Every conv of ``sources`` (conv -> the BatchNorm it reads through a ReLU) rebuilt from its
    BatchNorm (``from_bn``), BatchNorm's chunked backward, and ``regions`` recomputed: a conv whose
    BatchNorm is in a region keeps its input instead (a region keeps nothing to rebuild from)."""
    rebuilt = {conv: "from_bn" for conv, norm in sources.items()
               if not in_regions(norm, regions) and not in_regions(conv, regions)}
    return CompressionPlan(rebuilt, norm_storage="chunked", exact_companions=True, recompute=regions)


def region_costs(model: nn.Module, inputs: Tensor, sources: dict[str, str], scale: float) -> list[RegionCost]:
    """Each candidate region's saved bytes (``scale`` times those on ``inputs``, a sub-batch) and
    forward seconds, with the rest of ``with_regions`` around it; most bytes per second first. A
    candidate run whose rerun fails its checks is left out."""
    net = copy.deepcopy(model).train()
    compress(net, with_regions(sources, ()))
    base_bytes = measure_memory(net, inputs).total_bytes
    candidates = [*run_candidates(net, inputs), *region_candidates(model)]
    seconds = forward_seconds(net, inputs, candidates)
    costs = []
    for name in candidates:
        try:
            compress(net, with_regions(sources, (name,)))
            saved = base_bytes - measure_memory(net, inputs).total_bytes
        except (RuntimeError, TypeError):  # a run its parent does not call as one
            continue
        if saved > 0:
            costs.append(RegionCost(name, round(saved * scale), seconds[name] * scale))
    uncompress(net)
    return sorted(costs, key=lambda c: -c.bytes_per_second)


def forward_seconds(model: nn.Module, inputs: Tensor, names: list[str]) -> dict[str, float]:
    """Each named region's forward time: the least over ``1 + TIMED_FORWARDS`` training-mode forwards
    (a busy machine's stalls and the first call's warm-up are not the region's); a run's from its
    first layer's start to its last one's end."""
    started: dict[str, float] = {}
    took: dict[str, float] = dict.fromkeys(names, math.inf)
    hooks = []
    for name in names:
        first, last = name.split(RUN_JOIN)[0], name.split(RUN_JOIN)[-1]
        hooks.append(model.get_submodule(first).register_forward_pre_hook(
            lambda m, a, n=name: started.__setitem__(n, time.perf_counter())))
        hooks.append(model.get_submodule(last).register_forward_hook(
            lambda m, a, o, n=name: took.__setitem__(n, min(took[n], time.perf_counter() - started[n]))))
    try:
        for _ in range(1 + TIMED_FORWARDS):
            with torch.enable_grad():
                model(inputs)
    finally:
        for h in hooks:
            h.remove()
    return took


def exact_plans(model: nn.Module, inputs: Tensor, scale: float) -> tuple[list[CompressionPlan], list[RegionCost]]:
    """The search's plans, fastest first (the module docstring), and the region costs behind them."""
    sources = rebuildable_convs(model, inputs)
    costs = region_costs(model, inputs, sources, scale)
    plans = [CompressionPlan(exact_companions=True), with_regions(sources, ())]
    plans += [with_regions(sources, tuple(c.name for c in costs[:k])) for k in range(1, len(costs) + 1)]
    return plans, costs


def bare_plans(costs: list[RegionCost]) -> list[CompressionPlan]:
    """The same ladder with regions recomputed and nothing else (plain checkpointing), from one
    region to all: where lessmem's companions make a rerun's backward larger and slower (the tiny
    Llama's layers), this ladder's floor is the lower one."""
    return [CompressionPlan(exact_companions=False, recompute=tuple(c.name for c in costs[:k]))
            for k in range(1, len(costs) + 1)]


@dataclass(frozen=True)
class ExactLadder:
    """The ladder the search runs on: ``plans`` fastest first, the regions' ``costs``, the last plan's
    (the floor's) measured peak, and whether it is plain checkpointing's (``bare_plans``)."""

    plans: list[CompressionPlan]
    costs: list[RegionCost]
    floor_peak: int
    bare: bool


def exact_ladder(model: nn.Module, inputs: Tensor, scale: float, peak: Peak) -> ExactLadder:
    """``exact_plans``, or plain checkpointing's ladder where its floor, measured by ``peak``, is the
    lower: the one ladder whose floor decides what fits."""
    plans, costs = exact_plans(model, inputs, scale)
    floor = peak(plans[-1])
    if costs:
        bare = bare_plans(costs)
        bare_floor = peak(bare[-1])
        if bare_floor < floor:
            return ExactLadder(bare, costs, bare_floor, bare=True)
    return ExactLadder(plans, costs, floor, bare=False)


def fastest_fitting(plans: list[CompressionPlan], peak: Peak, budget_bytes: int,
                    known: dict[int, int] | None = None) -> tuple[int | None, dict[int, int]]:
    """The index of the first plan whose measured peak fits ``budget_bytes`` (None: not even the
    last) and every peak measured on the way (``known``: measured before), bisecting (later plans
    keep fewer bytes)."""
    measured: dict[int, int] = dict(known or {})

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
