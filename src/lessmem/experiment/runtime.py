"""Where and how a run computes: device, numeric precision, and the settings that must agree
with them (checked before anything is built)."""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig

from lessmem.experiment.distributed import world_size

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={name} but CUDA is not available; use device=cpu or auto")
    return torch.device(name)


def validate(cfg: DictConfig, device: torch.device) -> None:
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {cfg.precision!r}")
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ValueError("precision=fp16 needs CUDA (GradScaler); on CPU use bf16 or fp32")
    for key in ("epochs", "batch_size", "eval_batch_size", "memory_batch", "checkpoint_every"):
        if int(cfg[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {cfg[key]}")
    if (cfg.get("adaptive") or {}).get("every") and cfg.get("compile"):
        raise ValueError("adaptive.every > 0 re-assigns kernels during training; it cannot be combined with compile=true")
    if cfg.get("sync_bn") and world_size() > 1:
        if device.type != "cuda":
            raise ValueError(
                "sync_bn=true needs CUDA: torch's SyncBatchNorm has no CPU (gloo) implementation. "
                "On CPU use sync_bn=false (BatchNorm statistics per rank) or a model without BatchNorm"
            )
        if cfg.compression.get("norm_storage", "native") != "native":
            raise ValueError("sync_bn=true needs compression.norm_storage=native (SyncBatchNorm "
                             "replaces the reduced-storage BatchNorm layers)")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
