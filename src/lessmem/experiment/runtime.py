"""How a run's process computes: device and numeric precision (and the settings that must agree
with them, checked before anything is built), its randomness (per-epoch seeds and the RNG state a
checkpoint carries), and how it writes files (atomically, with the fault points of the crash tests).

The stochastic rounding of the b-bit storages draws its noise from the core's own counter-based
stream (``lessmem.core.rounding``), not from torch's generator: a run seeds it with its seed, and
a checkpoint carries its counter, so a resumed run rounds as the uninterrupted one would have.

Fault injection: ``LESSMEM_FAULT=<point>:<n>`` makes the process SIGKILL itself (no cleanup, like
``kill -9``) the n-th time it reaches ``fault_point(<point>)``. Points: ``train_step`` (after an
optimizer step) and ``replace_<file name>`` (an atomic write's temp file written, not yet renamed:
e.g. ``replace_checkpoint.pt``). Unset, a call costs one environment lookup.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from lessmem.core import load_rounding_state, rounding_state, set_rounding_seed
from lessmem.experiment.distributed import world_size
from lessmem.sensitivity import FIDELITIES, parse_bytes

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FAULT_ENV = "LESSMEM_FAULT"
_seen: dict[str, int] = {}


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
    for key in ("checkpoint_every_steps", "log_every_steps"):
        if int(cfg.get(key) or 0) < 0:
            raise ValueError(f"{key} must be >= 0 (0: off), got {cfg[key]}")
    if cfg.get("memory_budget") is not None:
        parse_bytes(str(cfg.memory_budget))  # a bad size fails here, before any data is read
    if cfg.get("fidelity", "lossy") not in FIDELITIES:
        raise ValueError(f"fidelity={cfg.fidelity}: choose one of {', '.join(FIDELITIES)}")
    if float(cfg.budget_step_ratio) < 1:
        raise ValueError(f"budget_step_ratio must be >= 1 (a step time over stock's; 1: no reruns), got {cfg.budget_step_ratio}")
    adaptive = cfg.get("adaptive") or {}
    if int(adaptive.get("start") or 0) < 0:
        raise ValueError(f"adaptive.start must be >= 0 (the epoch of the first re-choice), got {adaptive.get('start')}")
    if adaptive.get("every") and cfg.get("compile"):
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


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch`` of a run seeded ``seed``. Reseeding every epoch makes an epoch's
    randomness (shuffle, augmentation, dropout) independent of earlier epochs, so a resumed run
    matches an uninterrupted one without replaying RNG streams. The prime stride keeps the seeds
    of (seed, epoch) pairs distinct for any epoch count below it."""
    return seed * 100_003 + epoch


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A CPU generator seeded for epoch ``epoch`` (shuffles and augmentation draw from it)."""
    return torch.Generator().manual_seed(epoch_seed(seed, epoch))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    set_rounding_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors, tuples and numbers (numpy's key array as a list of ints), and
    the rounding noise's (seed, calls so far)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": (name, key.tolist(), int(pos), int(has_gauss), float(gauss)),
        "rounding": rounding_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    # Generators take their state as a CPU tensor; a checkpoint may have been loaded to the GPU.
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    random.setstate(state["python"])
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    if "rounding" in state:  # checkpoints written before the rounding stream lack it
        load_rounding_state(state["rounding"])


def fault_point(name: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] == int(nth or 1):
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


def atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(temp)`` then rename the temp file onto ``path``; a crash before the rename leaves
    the previous file intact. The temp file sits next to ``path`` (a rename within one file
    system) and carries the pid, so processes filling the same cache never share one.
    ``LESSMEM_FAULT=replace_<file name>:<n>`` kills the process between write and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    fault_point(f"replace_{path.name}")
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_write_text(text: str, path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))
