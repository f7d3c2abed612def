"""A map for a memory budget in bytes of the whole training step (``lessmem.fit``).

    fitted = lessmem.fit(model, (images, labels), budget="6GiB", optimizer=make_sgd)
    lessmem.compress(model, fitted.plan)

``fidelity`` says which options it may use: ``"lossy"`` (the default, described here: the least
gradient error that fits), ``"exact"`` (stock's gradients to float rounding: companions, ``from_bn``,
chunked BatchNorm, recomputed regions; the fastest plan that fits, ``exact_fit``) or ``"auto"``: the
exact plan when one fits and its measured step takes at most ``max_step_ratio`` (1.25) times
stock's, else the lossy one.

Steps: measure stock's whole-step peak (it fits: nothing to compress); measure the menu on a
sub-batch of the batch (bytes scaled to the whole batch), the whole-step peak of the menu's
smallest map (the floor: above the budget, nothing fits) and of a map near the bend of the peak
between them; from those measured steps a ``PeakModel`` predicts a map's peak from its saved
bytes, the knapsack picks the map of least criterion whose predicted peak is ``AIM`` (0.96) of the
budget, and one real step verifies it; a map over the budget adds its point to the model and the next pick is
tighter. With ``max_step_ratio`` > 1 the knapsack may also recompute the model's blocks (int8 codes inside
their rerun) where that lowers the criterion: such a map is verified alike (its peak kept apart from the
model), its step timed against stock's, and over ``max_step_ratio`` the search runs again with fewer
reruns. The menu and every measured point are cached per model, batch, optimizer, precision and device
(a json file).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core import (
    CompressionPlan,
    alternating_step_times,
    compress,
    load_rounding_state,
    measure_step_memory,
    rounding_state,
    training_step,
    uncompress,
)
from lessmem.sensitivity.byte_sizes import format_bytes, parse_bytes
from lessmem.sensitivity.exact_fit import RegionCost, exact_ladder, fastest_fitting
from lessmem.sensitivity.menu import CRITERIA, DEFAULT_CRITERION, MenuResult, ScoredPlan
from lessmem.sensitivity.menu_measure import measure_menu
from lessmem.sensitivity.menu_options import MenuOptions
from lessmem.sensitivity.peak_model import PeakModel

log = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Tensor, Tensor], Tensor]
# The menu fit() measures: every option a budget search needs, at a cost of a few training steps.
# BatchNorm / GELU / SiLU inputs and saved-tensor regions (a transformer's attention, gated MLP
# product, RMSNorm: without them a LoRA-tuned 135M Llama's floor kept 0.46x of stock's saved bytes):
# int8 and int2, one probe pass each.
# The model's blocks and runs of layers as recompute options too: freeing a region's internals buys
# finer codes elsewhere (the tiny Llama at 0.35x of stock's step: codes alone summed a tensor error of
# 0.27).
FIT_MENU = MenuOptions(kernels=(1, 2, 4), storages=("native", "bf16", "int8", "int4", "int2"),
                       norm_storages=("int8", "int2"), act_storages=("int8", "int2"), saved_storages=("int8", "int2"),
                       recompute=True)
# The menu is measured on a sub-batch of 1/MENU_FRACTION of the batch (1 to MENU_MAX_SAMPLES samples),
# its bytes scaled to the whole batch: each lossy probe is a forward/backward, so on the whole batch
# the menu alone would cost tens of training steps.
MENU_FRACTION = 16
MENU_MAX_SAMPLES = 8
STATIC_CATEGORIES = ("parameters", "gradients", "optimizer_state")
CLOSE_ENOUGH = 0.9  # a verified map at or above this fraction of the budget ends the search
# The peak the search aims at, as a fraction of the budget: the peak model's first predictions were
# off by -2.7% to +4.6% (tiny Llama, resnet20's curve); aiming at 0.96 keeps an under-prediction of up
# to 4% within the budget and an over-prediction of up to 6% above CLOSE_ENOUGH, so one verified step
# usually ends the search (aiming at the budget itself cost the tiny Llama 4 steps at 90.7 MiB).
AIM = 0.96


# Maps tried (each verified by a real step unless measured before) before a choice is taken as is.
MAX_TRIED = 4
FLOOR_ROOM = 1.01  # the floor map's budget over the least bytes: the knapsack rounds each option's bytes up
# Searches a lossy fit makes with fewer reruns when the chosen map's measured step exceeds max_step_ratio.
MAX_TIMED = 4
FIDELITIES = ("exact", "lossy", "auto")
# fidelity="auto": the exact plan while its step takes at most this many times stock's.
AUTO_STEP_RATIO = 1.25
TIMED_STEPS = 3  # steps of stock and of the chosen exact plan, alternating, behind its step-time ratio
# A ratio within this share of the limit it is held to is timed again on twice the steps (the median of
# three steps on a shared machine may land on either side: the choice would flip from one fit to the next).
NEAR_LIMIT = 0.05


def default_cache_dir() -> Path:
    return Path(os.environ.get("LESSMEM_CACHE") or Path.home() / ".cache" / "lessmem") / "budget"


@dataclass(frozen=True)
class BudgetFit:
    """The plan for a budget (``lessmem.compress(model, fitted.plan)``) and its measured peaks."""

    plan: CompressionPlan
    budget_bytes: int = 0
    batch_size: int = 0
    stock: bool = False  # stock already fits: nothing compressed
    predicted_peak_bytes: int = 0  # before its verification step
    step_peak_bytes: int = 0  # measured
    stock_step_peak_bytes: int = 0
    floor_step_peak_bytes: int | None = None  # the menu's smallest map (None when stock fits)
    saved_bytes: int = 0  # predicted saved-for-backward bytes
    score: dict[str, float] = field(default_factory=dict)
    criterion: str = DEFAULT_CRITERION
    verified: int = 0  # maps measured by a real step in this search
    known: bool = False  # the chosen map's peak was measured before this search: its prediction is that measurement
    fidelity: str = "lossy"  # the options the plan was chosen from ("exact" or "lossy")
    # measured step time over stock's (exact plans, lossy ones recomputing regions; median of TIMED_STEPS)
    step_time_ratio: float | None = None
    regions: tuple[RegionCost, ...] = ()  # exact plans: every recomputable region's measured bytes and seconds

    def record(self) -> dict[str, Any]:
        """The figures a run records (memory.json, metrics.json)."""
        return {"memory_budget_bytes": self.budget_bytes, "predicted_step_peak_bytes": self.predicted_peak_bytes,
                "budget_step_peak_bytes": self.step_peak_bytes, "budget_stock_fits": self.stock,
                "budget_floor_step_peak_bytes": self.floor_step_peak_bytes,
                "budget_predicted_grad_error": self.score.get("grad_error", 0.0), "budget_fidelity": self.fidelity,
                **({"budget_step_time_ratio": self.step_time_ratio} if self.step_time_ratio is not None else {})}


@dataclass
class BudgetProfile:
    """What fit() measures once per model, batch, optimizer, precision and device (cached)."""

    batch_size: int
    stock_peak: int
    menu: MenuResult | None = None
    floor_map: ScoredPlan | None = None
    floor_peak: int | None = None
    peaks: PeakModel = field(default_factory=PeakModel)
    # Measured peaks of maps recomputing regions, by plan: kept out of the peak model, which they
    # would bend (a rerun's transient and the codes' it replaces do not follow the saved bytes).
    rerun_peaks: dict[str, int] = field(default_factory=dict)


class NoFit(ValueError):
    """Even the smallest plan (the menu's smallest map, or the exact floor) does not fit the budget."""


def fit(model: nn.Module, batch: tuple[Tensor, Tensor], budget: str | int | float, *,
        optimizer: OptimizerFactory | None = None, loss_fn: LossFn = F.cross_entropy,
        amp_dtype: torch.dtype | None = None, criterion: str = DEFAULT_CRITERION, fidelity: str = "lossy",
        max_step_ratio: float = AUTO_STEP_RATIO) -> BudgetFit:
    """The map of least ``criterion`` whose whole training step (forward, backward,
    ``optimizer(params).step()``) on ``batch`` peaks within ``budget`` (bytes, or ``"6GiB"``,
    ``"750MiB"``), its plan named ``budget_<budget>``. Stock fits: ``stock=True`` and a plan that
    compresses nothing. Nothing fits:
    ``NoFit`` (a ValueError) naming the smallest peak the menu reaches and the largest batch
    that fits. ``model`` is not changed (measured on copies); measurements are cached in
    ``~/.cache/lessmem/budget`` (``$LESSMEM_CACHE/budget``). ``fidelity`` and ``max_step_ratio`` (a
    measured step over stock's: auto's bound for the exact plan, lossy's for recomputed regions; 1:
    codes only): the module docstring."""
    if fidelity not in FIDELITIES:
        raise ValueError(f"fidelity {fidelity!r}: choose one of {', '.join(FIDELITIES)}")
    budget_bytes = parse_bytes(budget)
    name = f"budget_{format_bytes(budget_bytes)}"
    step, cache_file, profile = _profile(model, batch, optimizer, loss_fn, amp_dtype)
    base = {"budget_bytes": budget_bytes, "batch_size": profile.batch_size, "criterion": criterion,
            "stock_step_peak_bytes": profile.stock_peak}
    if profile.stock_peak <= budget_bytes:
        _save(cache_file, profile)
        return BudgetFit(CompressionPlan(exact_companions=False, name=name, source="memory_budget"), stock=True,
                         predicted_peak_bytes=profile.stock_peak, step_peak_bytes=profile.stock_peak,
                         fidelity="exact" if fidelity != "lossy" else "lossy", **base)
    if fidelity != "lossy":
        _save(cache_file, profile)
        exact = _fit_exact(step, batch, budget_bytes, name, base, required=fidelity == "exact",
                           limit=None if fidelity == "exact" else max_step_ratio)
        if exact is not None and (fidelity == "exact" or exact.step_time_ratio <= max_step_ratio):
            return exact
        log.info("lessmem.fit: %s; the lossy plan instead (fidelity=auto)", "no exact plan fits" if exact is None else
                 f"the exact plan's step takes {exact.step_time_ratio:.2f}x stock's (> {max_step_ratio})")
    if profile.menu is None:
        _measure_floor(profile, step, batch, loss_fn, criterion)
        _save(cache_file, profile)
    allow, found, verified = max_step_ratio, None, 0
    for _ in range(MAX_TIMED):
        try:
            search = _least_error_fitting(profile, step, cache_file, budget_bytes, criterion, allow)
        except NoFit:
            if found is None:
                raise
            break  # nothing fits with fewer reruns
        verified += search.verified
        ratio = step.time_ratio(search.chosen.plan, limit=max_step_ratio) if search.chosen.plan.recompute else None
        found = (search, ratio)
        if ratio is None or ratio <= max_step_ratio:
            break
        # The menu predicts the reruns' forwards alone; the codes and the rerun's own storage cost
        # time too: shrink the reruns' allowance by the measured overrun and choose again.
        predicted_ratio = search.chosen.score["step_ratio"]
        allow = 1 + (predicted_ratio - 1) * max(max_step_ratio - 1, 0) / (ratio - 1)
        log.info("lessmem.fit: the map's step takes %.2fx stock's (reruns predicted %.2fx, max_step_ratio %s): "
                 "reruns within %.3fx", ratio, predicted_ratio, max_step_ratio, allow)
    assert found is not None
    search, ratio = found
    if ratio is not None and ratio > max_step_ratio:
        log.warning("lessmem.fit: keeping the map whose step takes %.2fx stock's (max_step_ratio %s): the searches "
                    "with fewer reruns found none within it that fits the budget", ratio, max_step_ratio)
    chosen = search.chosen
    base["floor_step_peak_bytes"] = search.floor_peak
    return BudgetFit(chosen.plan.replace(name=name, source="memory_budget"), predicted_peak_bytes=search.predicted,
                     step_peak_bytes=search.measured, saved_bytes=int(chosen.score["bytes"]), score=chosen.score,
                     verified=verified, known=search.known, step_time_ratio=ratio, **base)


@dataclass(frozen=True)
class _Search:
    """The map a budget search chose, its predicted and measured peaks, the floor it searched above."""

    chosen: ScoredPlan
    predicted: int
    measured: int
    known: bool  # measured before this search
    floor_peak: int
    verified: int  # maps measured by a real step in this search


def _least_error_fitting(profile: BudgetProfile, step: _Stepper, cache_file: Path, budget_bytes: int,
                         criterion: str, max_step_ratio: float) -> _Search:
    """The map of least ``criterion`` whose measured step peak fits ``budget_bytes``, regions
    recomputed as the menu predicts ``max_step_ratio`` allows: the peak model aims, a real step verifies."""
    assert profile.menu is not None and profile.floor_map is not None and profile.floor_peak is not None
    floor_map, floor_peak, verified = profile.floor_map, profile.floor_peak, 0
    least = profile.menu.least_bytes() * FLOOR_ROOM  # the knapsack's room above the floor (smallest_map)
    ladder_floor = smallest_map(profile.menu, criterion, max_step_ratio)
    if ladder_floor.score["bytes"] < floor_map.score["bytes"]:  # recomputed regions reach lower
        peak, known = _measured_peak(profile, step, ladder_floor, cache_file)
        verified += not known
        if peak < floor_peak:
            floor_map, floor_peak = ladder_floor, peak
            least = profile.menu.least_bytes(max_step_ratio) * FLOOR_ROOM
    if floor_peak > budget_bytes:
        raise NoFit(f"no map fits memory budget {format_bytes(budget_bytes)} at batch {profile.batch_size}: "
                    f"the smallest whole-step peak the menu reaches is {format_bytes(floor_peak)} "
                    f"(stock {format_bytes(profile.stock_peak)}); the largest batch that fits is about "
                    f"{largest_batch(profile.peaks, floor_map.score['bytes'], profile.batch_size, budget_bytes)}")
    best: tuple[ScoredPlan, int, int, bool] | None = None  # (map, predicted, measured, known) that fits
    tried: set[float] = set()
    aim = AIM * budget_bytes
    target = profile.peaks.saved_for(aim)
    while len(tried) < MAX_TRIED:
        choice = profile.menu.make_map(max(target, least), criterion, max_step_ratio=max_step_ratio)
        saved = choice.score["bytes"]
        if saved in tried:
            break
        tried.add(saved)
        predicted = int(profile.peaks.predict(saved))
        measured, known = _measured_peak(profile, step, choice, cache_file)
        verified += not known
        log.info("lessmem.fit: map saving %s: step peak %s (predicted %s, budget %s)%s", format_bytes(saved),
                 format_bytes(measured), format_bytes(predicted), format_bytes(budget_bytes),
                 " [measured before]" if known else "")
        if measured <= budget_bytes:
            if best is None or measured > best[2]:
                best = (choice, predicted, measured, known)
            if measured >= CLOSE_ENOUGH * budget_bytes:
                break
            target = max(profile.peaks.saved_for(aim), saved * 1.001)
        else:  # tighter: below this map's bytes by at least its overshoot
            target = min(profile.peaks.saved_for(aim), saved - (measured - budget_bytes))
    if best is None:  # the floor was measured and fits
        best = (floor_map, floor_peak, floor_peak, True)
    return _Search(*best, floor_peak=floor_peak, verified=verified)


def _measured_peak(profile: BudgetProfile, step: _Stepper, choice: ScoredPlan, cache_file: Path) -> tuple[int, bool]:
    """(``choice``'s whole-step peak, whether it was measured before): a map measured before needs
    no step; a new one is measured and kept in the cached profile (a codes-only map as a point of
    the peak model)."""
    saved, key = choice.score["bytes"], json.dumps(choice.plan.to_dict(), sort_keys=True)
    measured = profile.rerun_peaks.get(key) if choice.plan.recompute else dict(profile.peaks.points).get(saved)
    if measured is not None:
        return int(measured), True
    peak = step.peak(choice.plan).peak_bytes
    if choice.plan.recompute:
        profile.rerun_peaks[key] = peak
    else:
        profile.peaks.add(saved, peak)
    _save(cache_file, profile)
    return int(peak), False


def _fit_exact(step: _Stepper, batch: tuple[Tensor, Tensor], budget_bytes: int, name: str, base: dict[str, Any],
               required: bool, limit: float | None) -> BudgetFit | None:
    """The fastest exact plan whose step fits (``exact_fit``); none: ``NoFit`` if ``required``, else None.
    ``limit``: the step-time ratio the plan will be held to (timed longer near it)."""
    n = menu_samples(len(batch[0]))
    reports: dict[int, Any] = {}  # id(plan) -> its step's report

    def peak(plan: CompressionPlan) -> int:
        reports[id(plan)] = report = step.peak(plan)
        return report.peak_bytes

    ladder = exact_ladder(step.model, batch[0][:n], len(batch[0]) / n, peak)
    plans, costs = ladder.plans, ladder.costs
    log.info("lessmem.fit: exact floor %s (%s)", format_bytes(ladder.floor_peak),
             "plain checkpointing's ladder, lower than lessmem's" if ladder.bare else "lessmem's ladder")
    known = {len(plans) - 1: ladder.floor_peak}
    index, measured = fastest_fitting(plans, peak, budget_bytes, known)
    floor = measured[len(plans) - 1]
    log.info("lessmem.fit: exact plans measured (index: peak): %s; %d recomputable regions",
             {i: format_bytes(p) for i, p in sorted(measured.items())}, len(costs))
    if index is None:
        if not required:
            return None
        static = float(sum(reports[id(plans[-1])].by_category.get(c, 0) for c in STATIC_CATEGORIES))
        per_sample = (floor - static) / len(batch[0])
        largest = max(0, math.floor((budget_bytes - static) / per_sample)) if per_sample > 0 else len(batch[0])
        batches = (f"the largest batch that fits is about {largest}" if largest else
                   f"not even one sample fits: parameters, gradients and optimizer state take {format_bytes(static)}")
        raise NoFit(f"no exact plan fits memory budget {format_bytes(budget_bytes)} at batch {len(batch[0])}: the exact "
                    f"floor (every block and run of layers recomputed, from_bn, chunked BatchNorm) peaks at {format_bytes(floor)} "
                    f"(stock {format_bytes(base['stock_step_peak_bytes'])}); {batches}; fidelity=lossy reaches lower")
    plan = plans[index]
    return BudgetFit(plan.replace(name=name, source="memory_budget"), predicted_peak_bytes=measured[index],
                     step_peak_bytes=measured[index], floor_step_peak_bytes=floor, verified=len(measured),
                     fidelity="exact", step_time_ratio=step.time_ratio(plan, limit=limit), regions=tuple(costs), **base)


def step_time_ratio(model: nn.Module, batch: tuple[Tensor, Tensor], plan: CompressionPlan, *,
                    optimizer: OptimizerFactory | None = None, loss_fn: LossFn = F.cross_entropy,
                    amp_dtype: torch.dtype | None = None, repeats: int = TIMED_STEPS) -> float:
    """``plan``'s training step time over stock's on ``batch``: a copy of ``model`` compressed in turn
    with each, steps alternating (one untimed of each first), the ratio of the medians."""
    return _Stepper(model, batch, optimizer, loss_fn, amp_dtype).time_ratio(plan, repeats)


def budget_profile(model: nn.Module, batch: tuple[Tensor, Tensor], *, optimizer: OptimizerFactory | None = None,
                   loss_fn: LossFn = F.cross_entropy, amp_dtype: torch.dtype | None = None,
                   criterion: str = DEFAULT_CRITERION) -> BudgetProfile:
    """The menu, stock's and the floor's peaks and the peak model of ``fit`` (measured or cached)."""
    step, cache_file, profile = _profile(model, batch, optimizer, loss_fn, amp_dtype)
    if profile.menu is None:
        _measure_floor(profile, step, batch, loss_fn, criterion)
        _save(cache_file, profile)
    return profile


def _profile(model: nn.Module, batch: tuple[Tensor, Tensor], optimizer: OptimizerFactory | None, loss_fn: LossFn,
             amp_dtype: torch.dtype | None) -> tuple[_Stepper, Path, BudgetProfile]:
    step = _Stepper(model, batch, optimizer, loss_fn, amp_dtype)
    cache_file = default_cache_dir() / f"{step.key()}.json"
    return step, cache_file, _load(cache_file) or BudgetProfile(len(batch[0]), step.peak(None).peak_bytes)


def largest_batch(peaks: PeakModel, saved: float, batch_size: int, budget_bytes: float) -> int:
    """The largest batch whose predicted peak with a map saving ``saved`` bytes at ``batch_size``
    fits ``budget_bytes`` (0: not even one sample)."""
    per_batch = peaks.predict(saved) - peaks.static_bytes
    if per_batch <= 0:
        return batch_size
    return max(0, math.floor((budget_bytes - peaks.static_bytes) / per_batch * batch_size))


def _measure_floor(profile: BudgetProfile, step: _Stepper, batch: tuple[Tensor, Tensor], loss_fn: LossFn,
                   criterion: str) -> None:
    """The menu (on a sub-batch, bytes scaled up), stock's, the smallest map's and a map's near the bend."""
    n = menu_samples(len(batch[0]))
    log.info("lessmem.fit: stock step peak %s; measuring the menu on %d of %d samples, then two steps",
             format_bytes(profile.stock_peak), n, len(batch[0]))
    net = copy.deepcopy(step.model).train()
    menu = measure_menu(net, [(batch[0][:n], batch[1][:n])], FIT_MENU, loss_fn)
    profile.menu = scaled_menu(menu, len(batch[0]) / n)
    profile.peaks.add(profile.menu.stock_bytes, profile.stock_peak)
    profile.floor_map = smallest_map(profile.menu, criterion)
    least = profile.floor_map.score["bytes"]
    report = step.peak(profile.floor_map.plan)
    profile.floor_peak = report.peak_bytes
    profile.peaks.add(least, report.peak_bytes)
    profile.peaks.static_bytes = float(sum(report.by_category.get(c, 0) for c in STATIC_CATEGORIES))
    # A map near the bend of the peak (PeakModel): the chord from the floor to stock alone overshot
    # the convex peak by up to 11% between them (resnet18, 224 px). Kept within the middle 3/4.
    span = profile.menu.stock_bytes - least
    bend = min(max(profile.peaks.bend(), least + span / 8), profile.menu.stock_bytes - span / 8)
    mid = profile.menu.make_map(bend, criterion)
    profile.peaks.add(mid.score["bytes"], step.peak(mid.plan).peak_bytes)
    log.info("lessmem.fit: floor (the menu's smallest map) step peak %s; profile cached",
             format_bytes(profile.floor_peak))


def menu_samples(batch_size: int) -> int:
    """Samples of a batch of ``batch_size`` the menu is measured on."""
    return max(1, min(MENU_MAX_SAMPLES, batch_size // MENU_FRACTION))


def scaled_menu(menu: MenuResult, factor: float) -> MenuResult:
    """``menu`` with every byte count times ``factor`` (activations grow with the batch)."""
    d = menu.to_dict()
    for item in d["items"]:
        item["nbytes"] = [round(b * factor) for b in item["nbytes"]]
    d["stock_bytes"] = round(d["stock_bytes"] * factor)
    d["base_bytes"] = round(d["base_bytes"] * factor)
    for region in d.get("regions", []):
        region["delta_bytes"], region["freed_bytes"] = round(region["delta_bytes"] * factor), round(region["freed_bytes"] * factor)
    d["meta"] = {**d["meta"], "batch_size": round(d["meta"]["batch_size"] * factor), "measured_batch": d["meta"]["batch_size"]}
    return MenuResult.from_dict(d)


def smallest_map(menu: MenuResult, criterion: str = DEFAULT_CRITERION, max_step_ratio: float = 1.0) -> ScoredPlan:
    """The map of least saved bytes (regions recomputed as ``max_step_ratio`` allows), least
    ``criterion`` among maps within 1% of it: the knapsack's rounding needs that room."""
    return menu.make_map(menu.least_bytes(max_step_ratio) * FLOOR_ROOM, criterion, max_step_ratio=max_step_ratio)


class _Stepper:
    """Whole-step peaks of one copy of a model on one batch, with the optimizer, loss and precision
    of the run; the model, the rounding stream and the RNG are left as they were. The copy and its
    optimizer serve every map: the first measurement warms them up (optimizer state, lazy kernels),
    later ones recompress the copy and measure one step (a fresh copy's warm-up step would cost a
    training step per map; the peak is the same bytes)."""

    def __init__(self, model: nn.Module, batch: tuple[Tensor, Tensor], optimizer: OptimizerFactory | None,
                 loss_fn: LossFn, amp_dtype: torch.dtype | None) -> None:
        self.model, self.batch, self.optimizer = model, batch, optimizer
        self.loss_fn, self.amp_dtype = loss_fn, amp_dtype
        self.net: nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None

    def _apply(self, plan: CompressionPlan | None) -> int:
        """Compress the copy with ``plan`` (made on first use); the warm-up steps it needs."""
        warmup = int(self.net is None)
        if self.net is None:
            self.net = copy.deepcopy(self.model).train()
            self.opt = self.optimizer(self.net.parameters()) if self.optimizer else None
        if plan is None:
            uncompress(self.net)
        else:
            compress(self.net, plan)
        return warmup

    def time_ratio(self, plan: CompressionPlan, repeats: int = TIMED_STEPS, limit: float | None = None) -> float:
        """The median step time of ``plan`` over stock's, their steps alternating (one untimed of each first);
        within ``NEAR_LIMIT`` of ``limit``, ``2 * repeats`` more of each join them."""
        stock, planned = self._times(plan, repeats)
        ratio = statistics.median(planned) / statistics.median(stock)
        if limit is not None and abs(ratio - limit) <= NEAR_LIMIT * limit:
            more_stock, more_planned = self._times(plan, 2 * repeats)
            ratio = statistics.median(planned + more_planned) / statistics.median(stock + more_stock)
        return ratio

    def _times(self, plan: CompressionPlan, repeats: int) -> list[list[float]]:
        """Step times of stock and of ``plan``, alternating."""
        device = self.batch[0].device

        def step() -> object:
            return training_step(self.net, self.batch, self.opt, self.loss_fn, self.amp_dtype)

        state = rounding_state()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                return alternating_step_times([step, step], repeats, device=device,
                                              before=[lambda: self._apply(None), lambda: self._apply(plan)])
        finally:
            load_rounding_state(state)

    def peak(self, plan: CompressionPlan | None):
        warmup = self._apply(plan)
        device = self.batch[0].device
        state = rounding_state()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                return measure_step_memory(self.net, self.batch, loss_fn=self.loss_fn, amp_dtype=self.amp_dtype,
                                           optimizer=self.opt, warmup_steps=warmup, live=False)
        finally:
            load_rounding_state(state)

    def key(self) -> str:
        """Hash of what the peaks depend on: model structure, batch, optimizer, precision, device."""
        opt = None
        if self.optimizer is not None:
            built = self.optimizer([torch.zeros(1, requires_grad=True)])
            opt = [type(built).__name__, {k: repr(v) for k, v in sorted(built.defaults.items())}]
        fields = {"model": type(self.model).__qualname__,
                  "params": [(n, list(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()],
                  # with their settings: a stride, padding or in-place flag changes the peaks, not the params
                  "modules": [f"{type(m).__name__}({m.extra_repr()})" for m in self.model.modules()],
                  "batch": [(list(t.shape), str(t.dtype)) for t in self.batch], "device": str(self.batch[0].device),
                  "optimizer": opt, "loss": getattr(self.loss_fn, "__qualname__", type(self.loss_fn).__name__),
                  "amp": str(self.amp_dtype), "torch": torch.__version__,
                  "menu": [asdict(FIT_MENU), menu_samples(len(self.batch[0]))]}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _save(path: Path, profile: BudgetProfile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"batch_size": profile.batch_size, "stock_peak": profile.stock_peak,
            "menu": profile.menu.to_dict() if profile.menu else None,
            "floor_map": profile.floor_map.to_dict() if profile.floor_map else None, "floor_peak": profile.floor_peak,
            "points": profile.peaks.points, "static_bytes": profile.peaks.static_bytes, "rerun_peaks": profile.rerun_peaks}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _load(path: Path) -> BudgetProfile | None:
    if not path.is_file():
        return None
    try:
        d: Mapping[str, Any] = json.loads(path.read_text())
        menu = MenuResult.from_dict(d["menu"]) if d["menu"] else None
        if menu is not None and menu.criteria != CRITERIA:
            return None  # measured before a criterion existed
        return BudgetProfile(
            int(d["batch_size"]), int(d["stock_peak"]),
            menu, ScoredPlan.from_dict(d["floor_map"]) if d["floor_map"] else None, d["floor_peak"],
            PeakModel([tuple(p) for p in d["points"]], float(d["static_bytes"])), dict(d["rerun_peaks"]))
    except (ValueError, KeyError, TypeError):  # a torn or older file: measure again
        return None
