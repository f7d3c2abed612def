"""Divergence: a training step whose loss or gradient is not finite ends the run there.

A lossy map can make training diverge (1-bit BatchNorm inputs did on 2 of 4 resnet20 seeds):
from then on every step computes NaN, and a run that kept going would spend its remaining
epochs and report chance accuracy as if it had trained. The check runs after backward and before
the optimizer step, so the weights stay those of the last finite step. Under fp16 the loss scaler
owns overflowing gradients (it skips the step and lowers the scale), so only the loss is checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from lessmem.experiment.distributed import all_reduce_sum


def nonfinite_part(loss: torch.Tensor, params: Iterable[torch.nn.Parameter], check_grads: bool,
                   device: torch.device) -> str | None:
    """``"loss"`` or ``"gradient"`` when that is not finite on any rank, else None (every rank
    answers alike, so all of them stop at the same step)."""
    bad_loss = not math.isfinite(loss.item())
    bad_grad = False
    if check_grads and not bad_loss:
        grads = [p.grad for p in params if p.grad is not None]
        bad_grad = bool(grads) and not torch.isfinite(torch.nn.utils.get_total_norm(grads)).item()
    bad_loss, bad_grad = (v > 0 for v in all_reduce_sum([float(bad_loss), float(bad_grad)], device))
    return "loss" if bad_loss else "gradient" if bad_grad else None


def divergence_record(part: str, loss: torch.Tensor, epoch: int, step: int, global_step: int) -> dict[str, Any]:
    """What a run's metrics say about where it diverged (epoch and step count from 1)."""
    return {"in": part, "epoch": epoch + 1, "step": step + 1, "global_step": global_step + 1, "loss": loss.item()}


def divergence_message(record: dict[str, Any]) -> str:
    return (f"training diverged: non-finite {record['in']} at epoch {record['epoch']}, step {record['step']} "
            f"(loss {record['loss']}); the run stops there, the weights are those of the step before, and "
            f"metrics.json says 'diverged'. A lower learning rate or a less lossy map (more bits for "
            f"BatchNorm inputs) usually trains.")
