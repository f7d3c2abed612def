"""Checkpoints: atomic writes, RNG state, resume compatibility, loading with clear errors."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lessmem.experiment.faults import fault_point

RESUME_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "rng", "history")


def atomic_torch_save(obj: Any, path: Path) -> None:
    """Write to a temp file then rename: a crash mid-write leaves the previous file intact."""
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    fault_point("checkpoint_replace")
    os.replace(tmp, path)


def atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def read_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A training checkpoint for ``resume=true``; ValueError (one line) when it is unreadable."""
    try:
        ckpt = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # truncated / corrupt / not a torch file: torch raises many kinds
        detail = " ".join(str(e).split())[:200]
        raise ValueError(f"checkpoint {path} is unreadable (corrupt or truncated?): "
                         f"{type(e).__name__}: {detail}; delete it to start over") from e
    missing = [k for k in RESUME_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"checkpoint {path} is not a lessmem training checkpoint (missing {missing})")
    return ckpt


def check_compatible(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """The resumed run's settings that must match the checkpoint's."""
    for key in ("model", "compression", "optimizer", "scheduler", "batch_size", "seed"):
        if key in saved and saved[key] != now.get(key):
            raise ValueError(f"resume: {key} differs from the checkpoint's ({saved[key]} vs {now.get(key)})")


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load weights into ``model`` from a state_dict file or a training checkpoint (``'model'``)."""
    from lessmem.experiment.paths import resolve_path

    state = torch.load(resolve_path(path), map_location="cpu", weights_only=False)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    model.load_state_dict(state)
