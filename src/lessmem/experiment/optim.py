"""The ``optimizer`` and ``scheduler`` config groups."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def build_optimizer(ocfg: Mapping[str, Any], params: Any) -> torch.optim.Optimizer:
    name = ocfg["name"]
    if name == "sgd":
        return torch.optim.SGD(params, lr=ocfg["lr"], momentum=ocfg.get("momentum", 0.0),
                               weight_decay=ocfg.get("weight_decay", 0.0),
                               nesterov=bool(ocfg.get("nesterov", False)))
    if name == "adamw":
        return torch.optim.AdamW(params, lr=ocfg["lr"], betas=tuple(ocfg.get("betas", (0.9, 0.999))),
                                 weight_decay=ocfg.get("weight_decay", 0.01))
    raise ValueError(f"unknown optimizer {name!r}; available: sgd, adamw")


def build_scheduler(scfg: Mapping[str, Any], optimizer: torch.optim.Optimizer, epochs: int,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule: linear warmup, then cosine / step / constant. The cosine horizon is
    ``epochs``, so resume with the same ``epochs`` to reproduce an uninterrupted run."""
    total, warmup = epochs * steps_per_epoch, int(scfg.get("warmup_epochs", 0) * steps_per_epoch)
    name = scfg["name"]
    if name not in ("cosine", "step", "none"):
        raise ValueError(f"unknown scheduler {name!r}; available: cosine, step, none")
    floor = float(scfg.get("min_lr_ratio", 0.0))
    milestones = [int(m) * steps_per_epoch for m in scfg.get("milestones", [])]
    gamma = float(scfg.get("gamma", 0.1))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if name == "cosine":
            t = (step - warmup) / max(1, total - warmup)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
        if name == "step":
            return gamma ** sum(step >= m for m in milestones)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
