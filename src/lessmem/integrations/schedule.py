"""What a training framework's callback does with lessmem, without the framework: on the first
training batch, apply one plan (a map, a preset ``conf/compression/<name>.yaml``, or the plan
``lessmem.fit`` chooses for a whole-step memory budget) and measure the saved bytes against stock's
and the step's whole peak; with ``adapt_every``, every that many optimizer steps, re-measure the
menu on the current weights and re-choose within the saved bytes the budget's plan reached (as the
framework's own adaptive schedule does, ``lessmem.experiment.adaptive``).

A framework module hands each batch over as a ``BatchCall`` (its batch and how its loss is taken)
and logs the figures ``finish`` returns through the trainer's own loggers."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from lessmem.core import (
    CompressionPlan,
    compress,
    load_rounding_state,
    measure_memory,
    rounding_state,
    track_step_memory,
    uncompress,
)
from lessmem.experiment import conf_dir
from lessmem.sensitivity import DEFAULT_CRITERION, MenuOptions, fit, measure_menu, parse_bytes
from lessmem.sensitivity.fit import FIT_MENU

log = logging.getLogger(__name__)

# Prefix of every figure a callback logs.
PREFIX = "lessmem/"
LossOf = Callable[[nn.Module, Any], Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class BatchCall(nn.Module):
    """``model`` on one framework batch, reduced to its training loss by ``loss_of(model, batch)``, in
    the form lessmem's measurements call a model: ``call(x)`` runs the batch's first ``len(x)``
    samples, ``x`` standing for its first batch-major tensor (that tensor or a prefix of it, as
    ``lessmem.fit`` slices it), and returns the loss, so ``output_is_loss`` is the loss function. It
    shares the model's submodules, parameters and buffers without being the model's parent: module
    names, and so any plan chosen on it, are the model's own."""

    def __init__(self, model: nn.Module, batch: Any, loss_of: LossOf) -> None:
        super().__init__()
        for shared in ("_modules", "_parameters", "_buffers"):
            object.__setattr__(self, shared, getattr(model, shared))
        object.__setattr__(self, "model", model)  # not a child: no "model." before every name
        self.batch, self.loss_of = batch, loss_of
        leaves = tree_leaves(batch)
        self._first = next((i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.dim() > 0), None)
        if self._first is None:
            raise ValueError("lessmem: a training batch without a tensor with a batch dimension cannot be measured")

    @property
    def inputs(self) -> Tensor:
        """The batch's first batch-major tensor."""
        return tree_leaves(self.batch)[self._first]

    @property
    def arguments(self) -> tuple[Tensor, ...]:
        """What ``measure_memory`` calls it with: every tensor of the batch (the caller holds them)."""
        inputs = self.inputs
        return inputs, *(t for t in tree_leaves(self.batch) if isinstance(t, Tensor) and t is not inputs)

    def forward(self, x: Tensor, *held: Tensor) -> Tensor:
        """The loss of the batch's first ``len(x)`` samples, ``x`` in place of the first batch-major
        tensor (``held``: not used, passed so that a byte count leaves out what the caller holds)."""
        leaves, spec = tree_flatten(self.batch)
        size, n = leaves[self._first].shape[0], x.shape[0]
        rows = [x if i == self._first else t[:n] if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == size
                else t for i, t in enumerate(leaves)]
        return self.loss_of(self.model, tree_unflatten(rows, spec))

    def train(self, mode: bool = True) -> BatchCall:
        self.training = mode
        self.model.train(mode)
        return self


def output_is_loss(out: Tensor, _: Tensor) -> Tensor:
    """The loss function of a ``BatchCall``: its output is the loss already."""
    return out


def optimizer_like(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """A factory of optimizers of ``optimizer``'s class and settings over the parameters that train,
    what ``lessmem.fit`` measures a step with (``defaults`` may hold settings the class's constructor
    does not take: AdamW's ``decoupled_weight_decay``)."""
    kind = type(optimizer)
    accepted = inspect.signature(kind).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return lambda params: kind([p for p in params if p.requires_grad], **settings)


def preset_plan(name: str) -> CompressionPlan:
    """The plan of preset ``conf/compression/<name>.yaml`` (what ``lessmem-train compression=<name>``
    runs), or a ValueError listing the presets."""
    folder = conf_dir() / "compression"
    path = folder / f"{name}.yaml"
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        raise ValueError(f"lessmem: no compression preset {name!r} in {folder}; have {have}")
    return CompressionPlan.read(path)


@contextmanager
def _undisturbed(device: torch.device) -> Iterator[None]:
    """Measurements leave the RNG and the stochastic-rounding stream as they were: the run trains
    as it would have without them."""
    state = rounding_state()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        load_rounding_state(state)


class CompressionSchedule:
    """One plan applied on the first training batch, re-chosen every ``adapt_every`` optimizer steps.

    plan: a ``CompressionPlan`` (or a bare ``{pattern: spec}`` map, as ``CompressionPlan(map)``
        reads it); or ``preset``: a ``conf/compression`` name; or
        ``memory_budget`` (``"6GiB"``, bytes): ``lessmem.fit`` on the first batch with the
        trainer's optimizer and the batch's own loss. Exactly one of the three.
    adapt_every: with ``memory_budget``, re-measure the ``menu`` (default: the options ``lessmem.fit``
        chose from, so that what it reached stays reachable) on the batch of every that many optimizer
        steps and apply the map of least ``criterion`` within the saved-bytes ratio to stock the
        budget's plan reached and its reruns' predicted step (the whole-step peak follows the saved
        bytes); a re-choice the menu cannot make keeps the plan, said in a warning.
    measure_peak: profile the memory of each step a plan was chosen for (its whole peak is logged).
    """

    def __init__(self, plan: CompressionPlan | Mapping[str, Any] | None = None, *, preset: str | None = None,
                 memory_budget: str | int | None = None, adapt_every: int | None = None, menu: MenuOptions | None = None,
                 criterion: str = DEFAULT_CRITERION, measure_peak: bool = True) -> None:
        given = [k for k, v in (("plan", plan), ("preset", preset), ("memory_budget", memory_budget)) if v is not None]
        if len(given) != 1:
            raise ValueError("lessmem: give one plan, a preset or a memory_budget (which chooses the plan), "
                             f"got {' and '.join(given) if given else 'none'}")
        if adapt_every is not None and (memory_budget is None or adapt_every < 1):
            raise ValueError(f"lessmem: adapt_every re-chooses within a memory_budget every that many steps (>= 1); "
                             f"got adapt_every={adapt_every} with the {given[0]}")
        if isinstance(plan, Mapping):
            plan = CompressionPlan(plan, exact_companions=None, name="map")
        self.plan: CompressionPlan | None = plan if plan is not None else preset_plan(preset) if preset else None
        self.budget = parse_bytes(memory_budget) if memory_budget is not None else None
        self.adapt_every, self.menu, self.criterion = adapt_every, menu or FIT_MENU, criterion
        self.measure_peak = measure_peak
        self.plans = 0  # plans applied so far
        self.step: int | None = None  # the optimizer step the last plan was chosen at
        self.stock_bytes = 0  # stock's saved bytes on the first batch
        self.ratio = 1.0  # saved bytes of the first plan / stock's: what a re-choice stays within
        self.reruns = 1.0  # the first plan's reruns' predicted step over stock's: a re-choice's allowance
        self._busy = False
        self._pending: dict[str, float] = {}
        self._tracking: AbstractContextManager[Any] | None = None  # the step's profile, while it runs
        self._tracker: Any = None  # what it reports into

    def due(self, step: int) -> bool:
        """Whether the batch of optimizer step ``step`` gets a plan: the first batch, then with
        ``adapt_every`` the first batch of every ``adapt_every``-th step (never while measuring)."""
        if self._busy:
            return False
        if self.step is None:
            return True
        return self.adapt_every is not None and step != self.step and step % self.adapt_every == 0

    def apply(self, model: nn.Module, call: BatchCall, step: int, *, optimizer: torch.optim.Optimizer | None = None,
              copies: bool = False) -> CompressionPlan:
        """Choose the plan for ``call``'s batch, compress ``model`` with it in place and start
        profiling the step (``finish`` ends it); returns the plan. ``copies``: measure saved bytes on
        copies of ``call`` (a forward with side effects, such as a training step that logs)."""
        device = next(model.parameters()).device
        self._busy = True
        try:
            with _undisturbed(device):
                figures: dict[str, float] = {}
                if self.step is None:
                    self.stock_bytes = self._saved_bytes(call, copies)
                    plan = self.plan if self.plan is not None else self._fitted(call, optimizer, figures)
                else:
                    # The menu on stock layers with the current weights (a copy: the model keeps its
                    # compressed layers and its optimizer state).
                    stock = uncompress(copy.deepcopy(call)).train()
                    # regions only where the first plan may rerun them: codes-only re-choices ignore them
                    options = self.menu if self.reruns > 1 else dataclasses.replace(self.menu, recompute=False)
                    menu = measure_menu(stock, [(call.inputs, call.inputs)], options, output_is_loss)
                    try:
                        plan = menu.make_map(self.ratio, self.criterion, max_step_ratio=self.reruns).plan
                    except ValueError as e:  # below this menu's floor: training goes on with the plan it has
                        log.warning("lessmem: step %d keeps its plan: %s", step, e)
                        plan = self.plan
                compress(model, plan)
                saved = self._saved_bytes(call, copies)
        finally:
            self._busy = False
        ratio = saved / self.stock_bytes if self.stock_bytes else 1.0
        if self.plans == 0:  # the first plan of the run (a resumed one keeps the ratio it had)
            self.ratio = min(1.0, ratio)
        self.plan, self.step = plan, step
        self.plans += 1
        figures |= {"stock_saved_bytes": self.stock_bytes, "saved_bytes": saved, "saved_ratio": ratio, "plans": self.plans}
        self._pending = {PREFIX + k: float(v) for k, v in figures.items()}
        if self.measure_peak:
            self._tracking = track_step_memory(device, live=False)
            self._tracker = self._tracking.__enter__()
        return plan

    def state_dict(self) -> dict[str, Any]:
        """What a run resumed from a trainer's checkpoint needs to go on with the plan in force
        (``load_state_dict``); JSON-ready."""
        return {"plan": None if self.plan is None else self.plan.to_dict(), "plans": self.plans,
                "ratio": self.ratio, "reruns": self.reruns}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from ``state_dict()``: a budget's plan comes back and is applied on the next batch
        without fitting again (a fit whose measurement cache has grown may choose another map); a
        given plan or preset stays the one given now."""
        if self.budget is not None and state.get("plan") is not None:
            self.plan = CompressionPlan.from_dict(state["plan"])
        self.plans, self.ratio, self.reruns = int(state["plans"]), float(state["ratio"]), float(state["reruns"])

    def finish(self) -> dict[str, float]:
        """The figures of the step a plan was chosen for, once it has ended (its whole peak, if
        profiled); ``{}`` for any other step."""
        figures, self._pending = self._pending, {}
        if self._tracking is not None:
            self._tracking.__exit__(None, None, None)
            figures[PREFIX + "step_peak_bytes"] = float(self._tracker.report.peak_bytes)
            self._tracking = None
        return figures

    def _fitted(self, call: BatchCall, optimizer: torch.optim.Optimizer | None, figures: dict[str, float]) -> CompressionPlan:
        fitted = fit(call, (call.inputs, call.inputs), self.budget, criterion=self.criterion, loss_fn=output_is_loss,
                     optimizer=optimizer_like(optimizer) if optimizer is not None else None)
        figures |= {k: v for k, v in fitted.record().items() if isinstance(v, int | float)}
        self.reruns = fitted.score.get("step_ratio", 1.0)
        return fitted.plan

    @staticmethod
    def _saved_bytes(call: BatchCall, copies: bool) -> int:
        net = copy.deepcopy(call) if copies else call
        return measure_memory(net, net.arguments).total_bytes
