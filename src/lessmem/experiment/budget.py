"""``memory_budget=6GiB``: the run's map chosen by ``lessmem.fit`` for its model, batch, optimizer,
loss, precision and device; the chosen map file goes into the run directory. ``plan_for_config``:
what larger batches would cost under the same budget (``lessmem-plan``)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from lessmem.core import CompressionPlan
from lessmem.experiment.data import fixed_batches
from lessmem.experiment.probes import first_batch
from lessmem.experiment.runtime import PRECISIONS, resolve_device, seed_everything
from lessmem.experiment.spec import OptimSpec, RunSpec, model_spec, resolve_run
from lessmem.experiment.task import Task, task_of
from lessmem.sensitivity import (
    BudgetFit,
    PlanRow,
    budget_profile,
    fit,
    format_bytes,
    parse_bytes,
    plan_batches,
    step_time_ratio,
)

log = logging.getLogger(__name__)


def choose_for_budget(model: nn.Module, batch: tuple[Tensor, Tensor], spec: RunSpec) -> tuple[RunSpec, BudgetFit]:
    """(``spec`` with the budget's plan, measured at ``batch`` (the run's batch size), the fit).
    Stock fits: stock, said in one line. Nothing fits: ``NoFit`` (a ValueError, one error line).
    The plan's file goes into the run directory."""
    budget = spec.memory_budget
    if not spec.plan.is_stock:
        log.warning("lessmem: memory_budget=%s replaces compression %r: the map is the one chosen for the budget",
                    budget, spec.plan.label)
    net, on_device, settings = _as_measured(model, batch, spec)
    fitted = fit(net, on_device, budget, fidelity=spec.fidelity, max_step_ratio=spec.budget_step_ratio, **settings)
    plan = fitted.plan
    if fitted.stock:
        log.warning("lessmem: stock already fits memory_budget=%s at batch %d (whole-step peak %s): training stock",
                    budget, fitted.batch_size, format_bytes(fitted.step_peak_bytes))
    else:
        path = plan.write(spec.out_dir / f"{plan.name}.yaml",
                          comment=f"lessmem.fit: memory_budget={budget} at batch {fitted.batch_size}, whole-step "
                                  f"peak {fitted.step_peak_bytes} bytes measured, {fitted.predicted_peak_bytes} predicted")
        plan = plan.replace(source=str(path))
    return with_budget_plan(spec, plan), fitted


def with_budget_plan(spec: RunSpec, plan: CompressionPlan) -> RunSpec:
    """``spec`` training ``plan``, the map its ``memory_budget`` chose (the memory figures at the run's
    batch size, where the budget was measured). A resumed run passes the plan its checkpoint kept:
    fitting again could choose another map (the measurement cache has grown since)."""
    data = replace(spec.data, memory_batch=spec.data.batch_size)
    return replace(spec, plan=plan, plan_given=f"memory_budget={spec.memory_budget}", data=data)


def plan_for_config(cfg: DictConfig, factors: tuple[float, ...]) -> tuple[RunSpec, int, list[PlanRow], BudgetFit | None]:
    """(the run's spec, ``memory_budget`` in bytes, one row per batch size: ``factors`` x stock's
    largest batch within the budget, each with the best lossy map's predicted whole-step peak and
    error, and with ``fidelity`` exact or auto the plan ``lessmem-train`` would take at ``batch_size``).
    Measured once, at ``batch_size`` on the run's first validation batch, as ``memory_budget`` is
    in training (``lessmem.fit``'s profile and cache); the other batch sizes are predictions."""
    if cfg.get("memory_budget") is None:
        raise ValueError("lessmem-plan needs memory_budget (e.g. memory_budget=6GiB): the plan is for one budget")
    spec = resolve_run(cfg)
    budget = parse_bytes(spec.memory_budget)
    seed_everything(spec.seed)
    model = spec.model.build()  # before the loaders, as in training: the same initial weights
    _, val_loader = spec.data.loaders(spec.seed, spec.ddp)
    net, on_device, settings = _as_measured(model, first_batch(val_loader, spec.data.batch_size), spec)
    fitted = None if spec.fidelity == "lossy" else fit(net, on_device, budget, fidelity=spec.fidelity,
                                                       max_step_ratio=spec.budget_step_ratio, **settings)
    rows = plan_batches(budget_profile(net, on_device, **settings), budget, factors, max_step_ratio=spec.budget_step_ratio)
    return spec, budget, rows, fitted


def step_timer(cfg: DictConfig, batch_size: int, split: str, repeats: int) -> Callable[[CompressionPlan], float]:
    """A plan's training step time over stock's for the model of the train config ``cfg`` (its
    seeded init, optimizer, loss, precision, device and layout) on its first fixed batch of
    ``batch_size`` from ``split``: what ``lessmem-sensitivity`` measures of the map it writes (the
    menu predicts only the reruns of recomputed regions; codes and rebuilds cost time too)."""
    seed = int(cfg.get("seed", 0))
    seed_everything(seed)
    device = resolve_device(str(cfg.get("device", "auto")))
    layout = torch.channels_last if cfg.get("channels_last") else torch.contiguous_format
    model = model_spec(cfg.model).build().to(device, memory_format=layout)
    x, y = fixed_batches(cfg.dataset, 1, batch_size, split, seed)[0]
    batch = (x.to(device), y.to(device))
    settings = _step_settings(OptimSpec(OmegaConf.to_container(cfg.optimizer, resolve=True), {}), task_of(cfg),
                              str(cfg.get("precision", "fp32")))
    return lambda plan: step_time_ratio(model, batch, plan, repeats=repeats, **settings)


def _as_measured(model: nn.Module, batch: tuple[Tensor, Tensor],
                 spec: RunSpec) -> tuple[nn.Module, tuple[Tensor, Tensor], dict[str, Any]]:
    """A copy of ``model`` and ``batch`` on the run's device and layout, and the step settings
    (optimizer, loss, autocast dtype) ``fit`` / ``budget_profile`` measure with: one definition,
    so ``lessmem-plan`` and ``lessmem-train memory_budget=`` measure alike and share a cache entry."""
    net = copy.deepcopy(model).to(spec.device, memory_format=spec.memory_format)
    return net, (batch[0].to(spec.device), batch[1].to(spec.device)), _step_settings(spec.optim, spec.task, spec.precision)


def _step_settings(optim: OptimSpec, task: Task, precision: str) -> dict[str, Any]:
    """The training step's settings ``lessmem.fit`` and ``step_time_ratio`` take: optimizer factory,
    loss, autocast dtype."""
    return {"optimizer": optim.optimizer_for, "loss_fn": task.criterion, "amp_dtype": PRECISIONS[precision]}
