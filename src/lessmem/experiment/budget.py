"""``memory_budget=6GiB``: the run's map chosen by ``lessmem.fit`` for its model, batch, optimizer,
loss, precision and device; the chosen map file goes into the run directory."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from lessmem.experiment.compression import CompressionChoice
from lessmem.sensitivity import BudgetChoice, fit, format_bytes, write_map_yaml

log = logging.getLogger(__name__)


def choose_for_budget(model: nn.Module, batch: tuple[Tensor, Tensor], budget: str | int,
                      make_optimizer: Callable, loss_fn: Callable[[Tensor, Tensor], Tensor],
                      amp_dtype: torch.dtype | None, out_dir: Path) -> tuple[CompressionChoice, BudgetChoice]:
    """(the run's compression choice, the budget choice) for ``budget``; stock fits: stock, said in one
    line. Nothing fits: ``NoFit`` (a ValueError, one error line)."""
    chosen = fit(model, batch, str(budget), optimizer=make_optimizer, loss_fn=loss_fn, amp_dtype=amp_dtype)
    if chosen.stock:
        log.warning("lessmem: stock already fits memory_budget=%s at batch %d (whole-step peak %s): training stock",
                    budget, chosen.batch_size, format_bytes(chosen.step_peak_bytes))
        return CompressionChoice(name=chosen.label, map={}, exact_companions=False, norm_storage="native",
                                 source="memory_budget"), chosen
    path = write_map_yaml(chosen.map, out_dir / f"{chosen.label}.yaml", name=chosen.label,
                          comment=f"lessmem.fit: memory_budget={budget} at batch {chosen.batch_size}, whole-step "
                                  f"peak {chosen.step_peak_bytes} bytes measured, {chosen.predicted_peak_bytes} predicted",
                          norm_storage=chosen.norm_storage, act_storage=chosen.act_storage)
    return CompressionChoice(name=chosen.label, map=chosen.map, exact_companions=True,
                             norm_storage=chosen.norm_storage, act_storage=chosen.act_storage,
                             source=str(path)), chosen
