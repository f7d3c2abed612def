"""Adaptive compression schedule: re-choose the map during training from measurements on the
current weights (GACT re-estimates its bit allocation the same way, every N steps).

The menu (conv pooling ``kernels`` x ``storages``, BatchNorm ``norm_storages``, GELU / SiLU
``act_storages``) is re-measured, and map plus storages are chosen by the menu knapsack on
``criterion`` within ``budget`` (total saved bytes, fraction of stock); ``storages: [native]`` and
no norm / act storages re-choose pooling kernels alone.

The choice in force is ``{"map", "norm_storage", "act_storage"}``: checkpoints carry it and
resume re-applies it. Deterministic, so every DDP rank arrives at the same choice.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lessmem.core import measure_memory, uncompress
from lessmem.experiment.spec import RunSpec
from lessmem.sensitivity import DEFAULT_CRITERION, MenuOptions, measure_menu

log = logging.getLogger(__name__)


def adapt_compression(net: nn.Module, probe: tuple[Tensor, Tensor], spec: RunSpec, epoch: int,
                      x_memory: Tensor, logger: Any) -> dict[str, Any]:
    """Re-measure on the fixed ``probe`` batch (with the run's loss), apply the new choice to
    ``net`` (the module itself, not its DDP / compiled wrapper) and log it; returns the choice in force."""
    device = next(net.parameters()).device
    batch = [(probe[0].to(device), probe[1].to(device))]
    was_training = net.training
    net.train()
    adapted, change = _menu_choice(net, batch, spec.adaptive, spec.task.criterion)
    spec.choice.adapted(adapted).apply(net)
    # Measured in train mode, as training runs it (after an evaluation the net is in eval mode).
    change = {"epoch": epoch, **change, "saved_bytes": measure_memory(net, x_memory.to(device)).total_bytes}
    net.train(was_training)
    if spec.ddp.is_main:
        with (spec.out_dir / "adaptive.jsonl").open("a") as f:
            f.write(json.dumps(change) + "\n")
        log.info("adaptive choice at epoch %d: %s", epoch,
                 ", ".join(f"{k} {v:.4g}" for k, v in change.items() if isinstance(v, float)))
    logger.log({f"adaptive/{k}": v for k, v in change.items() if isinstance(v, int | float)} | {"epoch": epoch})
    return adapted


def _menu_choice(model: nn.Module, batch: list[tuple[Tensor, Tensor]], acfg: dict[str, Any],
                 loss_fn: Callable[[Tensor, Tensor], Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    # The menu is measured on stock layers carrying the current weights (a copy: the run's model
    # keeps its compressed layers and optimizer state).
    stock = uncompress(copy.deepcopy(model)).train()
    menu = measure_menu(stock, batch, MenuOptions.from_config(acfg), loss_fn)
    criterion = str(acfg.get("criterion") or DEFAULT_CRITERION)
    choice = menu.make_map(float(acfg.get("budget")), criterion)
    adapted = {"map": choice.map, "norm_storage": choice.norm_storage, "act_storage": choice.act_storage}
    return adapted, {"predicted_ratio": choice.score["ratio"], "criterion": criterion,
                     **{k: choice.score[k] for k in ("grad_error", "cosine", "loss_change")},
                     "map": {n: o for n, o in choice.map.items() if o != "1"},
                     "norm_storage": choice.norm_storage, "act_storage": choice.act_storage}
