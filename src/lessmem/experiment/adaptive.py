"""Adaptive compression schedule: re-choose the map during training from measurements on the
current weights (GACT re-estimates its bit allocation the same way, every N steps).

The menu (conv pooling ``kernels`` x ``storages``, BatchNorm ``norm_storages``, GELU / SiLU
``act_storages``) is re-measured, and map plus storages are chosen by the menu knapsack on
``criterion`` within ``budget`` (total saved bytes, fraction of stock); ``storages: [native]`` and
no norm / act storages re-choose pooling kernels alone.

The plan in force (the menu's, saved-region storages included, under the run's name): checkpoints
carry it and resume re-applies it. Deterministic, so every DDP rank arrives at the same plan.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lessmem.core import STORAGE_SETTINGS, CompressionPlan, compress, measure_memory, uncompress
from lessmem.experiment.spec import AdaptiveSpec, RunSpec
from lessmem.sensitivity import ScoredPlan, measure_menu

log = logging.getLogger(__name__)


def adapt_compression(net: nn.Module, probe: tuple[Tensor, Tensor], spec: RunSpec, epoch: int,
                      x_memory: Tensor, logger: Any) -> CompressionPlan:
    """Re-measure on the fixed ``probe`` batch (with the run's loss), apply the new plan to ``net``
    (the module itself, not its DDP / compiled wrapper) and log it; returns the plan in force."""
    device = next(net.parameters()).device
    batch = [(probe[0].to(device), probe[1].to(device))]
    was_training = net.training
    net.train()
    criterion = spec.adaptive.criterion
    chosen = _menu_choice(net, batch, spec.adaptive, spec.task.criterion)
    plan = chosen.plan.replace(name=spec.plan.name, source="adaptive")
    compress(net, plan)
    # Measured in train mode, as training runs it (after an evaluation the net is in eval mode).
    change = {"epoch": epoch, "predicted_ratio": chosen.score["ratio"], "criterion": criterion,
              **{k: chosen.score[k] for k in ("grad_error", "cosine", "loss_change")},
              "map": {n: o for n, o in plan.map.items() if o != "1"},
              **{k: getattr(plan, k) for k in STORAGE_SETTINGS},
              "saved_bytes": measure_memory(net, x_memory.to(device)).total_bytes}
    net.train(was_training)
    if spec.ddp.is_main:
        with (spec.out_dir / "adaptive.jsonl").open("a") as f:
            f.write(json.dumps(change) + "\n")
        log.info("adaptive choice at epoch %d: %s", epoch,
                 ", ".join(f"{k} {v:.4g}" for k, v in change.items() if isinstance(v, float)))
    logger.log({f"adaptive/{k}": v for k, v in change.items() if isinstance(v, int | float)} | {"epoch": epoch})
    return plan


def _menu_choice(model: nn.Module, batch: list[tuple[Tensor, Tensor]], adaptive: AdaptiveSpec,
                 loss_fn: Callable[[Tensor, Tensor], Tensor]) -> ScoredPlan:
    # The menu is measured on stock layers carrying the current weights (a copy: the run's model
    # keeps its compressed layers and optimizer state).
    stock = uncompress(copy.deepcopy(model)).train()
    menu = measure_menu(stock, batch, adaptive.menu, loss_fn)
    return menu.make_map(adaptive.budget, adaptive.criterion)
