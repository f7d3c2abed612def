"""The ``optimizer`` and ``scheduler`` config groups: each file names its builder (``_target_``)
and Hydra's ``instantiate`` makes it; an optimizer takes the parameters, a schedule the optimizer,
the run's epochs and steps per epoch. Schedules are per step: a linear warmup, then the shape.
The cosine horizon is ``epochs``, so resume with the same ``epochs`` to reproduce an uninterrupted run."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

Schedule = torch.optim.lr_scheduler.LambdaLR


def cosine_schedule(optimizer: torch.optim.Optimizer, epochs: int, steps_per_epoch: int,
                    warmup_epochs: float = 0.0, min_lr_ratio: float = 0.0) -> Schedule:
    """Cosine decay to ``min_lr_ratio`` x lr over the run."""
    total, warmup = epochs * steps_per_epoch, int(warmup_epochs * steps_per_epoch)

    def shape(step: int) -> float:
        t = (step - warmup) / max(1, total - warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return _with_warmup(optimizer, warmup, shape)


def step_schedule(optimizer: torch.optim.Optimizer, epochs: int, steps_per_epoch: int, warmup_epochs: float = 0.0,
                  milestones: Sequence[int] = (), gamma: float = 0.1) -> Schedule:
    """The lr times ``gamma`` at each milestone epoch."""
    steps = [int(m) * steps_per_epoch for m in milestones]
    return _with_warmup(optimizer, int(warmup_epochs * steps_per_epoch),
                        lambda step: gamma ** sum(step >= m for m in steps))


def constant_schedule(optimizer: torch.optim.Optimizer, epochs: int, steps_per_epoch: int,
                      warmup_epochs: float = 0.0) -> Schedule:
    """A constant lr (after the warmup)."""
    return _with_warmup(optimizer, int(warmup_epochs * steps_per_epoch), lambda step: 1.0)


def _with_warmup(optimizer: torch.optim.Optimizer, warmup: int, shape: Callable[[int], float]) -> Schedule:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / warmup if step < warmup else shape(step))
