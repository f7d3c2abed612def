"""Process-group plumbing for ``torchrun`` jobs: where this process sits and sums over ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import distributed as dist
from torch import nn


@dataclass
class DistInfo:
    """This process's place in a ``torchrun`` job; rank 0 of 1 without one."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # init_process_group was called here (destroyed at the end of run)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Ranks of the running group, else what ``torchrun`` announces in ``WORLD_SIZE``."""
    if initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return not initialized() or dist.get_rank() == 0


def setup_distributed(cfg: Any, device: torch.device) -> tuple[DistInfo, torch.device]:
    """Join the process group ``torchrun`` describes (WORLD_SIZE / RANK / LOCAL_RANK in the
    environment). ``distributed.backend``: auto = nccl on CUDA, gloo on CPU. Each rank uses GPU
    ``LOCAL_RANK`` when the device is CUDA. One process (no torchrun): nothing to do."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not initialized():
        return DistInfo(), device
    dcfg = cfg.get("distributed") or {}
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        backend = str(dcfg.get("backend", "auto"))
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=int(dcfg.get("timeout_s", 1800))))
        owns = True
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, owns), device


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (unchanged in one process)."""
    if not initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum per-rank numbers over all ranks (unchanged in one process)."""
    if not initialized() or dist.get_world_size() == 1:
        return values
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=on)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_mean_(t: torch.Tensor) -> torch.Tensor:
    """Average a tensor over the ranks in place (unchanged in one process)."""
    if initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def teardown(info: DistInfo) -> None:
    """Leave the process group if this process created it."""
    if info.owns_group:
        dist.barrier()
        dist.destroy_process_group()
