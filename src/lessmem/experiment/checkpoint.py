"""Training checkpoints: what a run saves, reading one back, restoring a run from it.

A checkpoint holds tensors and plain data only (numbers, strings, lists, tuples, dicts), so it
is read with ``torch.load(weights_only=True)``: loading a file never runs code from it.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lessmem.experiment.compression import apply_adapted
from lessmem.experiment.files import atomic_torch_save
from lessmem.experiment.paths import resolve_path
from lessmem.experiment.seeds import rng_state, set_rng_state

RESUME_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "rng", "history")


def load_torch_file(path: Path, device: torch.device | str = "cpu") -> Any:
    """``torch.load(weights_only=True)``; ValueError (one line) when the file is unreadable or
    holds objects other than tensors and plain data."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused a global (a class, a function)
        raise ValueError(f"checkpoint {path} holds objects other than tensors and plain data; it is "
                         f"not loaded, since unpickling it could run code ({_refusal(e)})") from e
    except Exception as e:  # truncated / corrupt / not a torch file: torch raises many kinds
        detail = " ".join(str(e).split())[:200]
        raise ValueError(f"checkpoint {path} is unreadable (corrupt or truncated?): "
                         f"{type(e).__name__}: {detail}; delete it to start over") from e


def _refusal(e: pickle.UnpicklingError) -> str:
    """The line of torch's weights_only message that names what was refused."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line]
    return (named or lines or [type(e).__name__])[0][:200]


def checkpoint_to_resume(cfg: DictConfig, path: Path, device: torch.device) -> dict[str, Any] | None:
    """The checkpoint ``resume=true`` continues from (None without resume), read up front so a
    missing or unreadable one fails before anything is built."""
    if not cfg.resume:
        return None
    if not path.exists():
        raise FileNotFoundError(
            f"resume=true but there is no checkpoint at {path}; point out_dir (or hydra.run.dir) "
            "at the directory of the run to continue"
        )
    return read_checkpoint(path, device)


def read_checkpoint(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A training checkpoint for ``resume=true``; ValueError (one line) when it is unreadable."""
    ckpt = load_torch_file(path, device)
    missing = [k for k in RESUME_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"checkpoint {path} is not a lessmem training checkpoint (missing {missing})")
    return ckpt


def check_compatible(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """The resumed run's settings that must match the checkpoint's."""
    for key in ("model", "compression", "optimizer", "scheduler", "batch_size", "seed"):
        if key in saved and saved[key] != now.get(key):
            raise ValueError(f"resume: {key} differs from the checkpoint's ({saved[key]} vs {now.get(key)})")


def save_checkpoint(path: Path, net: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    scaler: torch.amp.GradScaler, *, epoch: int, history: list[dict[str, Any]],
                    memory: dict[str, Any], cfg: DictConfig, adaptive_map: dict[str, Any] | None) -> None:
    """Everything ``resume=true`` needs to continue after ``epoch`` epochs, written atomically."""
    atomic_torch_save({
        "model": net.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
        "epoch": epoch, "rng": rng_state(), "history": history, "memory": memory,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "adaptive_map": adaptive_map,
    }, path)


def restore_checkpoint(ckpt: dict[str, Any], cfg: DictConfig, net: nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: Any, scaler: torch.amp.GradScaler) -> tuple[int, list[dict[str, Any]], dict[str, Any] | None]:
    """Put a run back where ``ckpt`` left it: weights, optimizer, schedule, scaler, RNG (with the
    rounding noise's counter), and the adaptive map in force. Returns (epochs done, history, adaptive map)."""
    check_compatible(ckpt.get("config", {}), OmegaConf.to_container(cfg, resolve=True))
    net.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    # Recompute the lr from the (possibly longer) schedule: resuming with more epochs than
    # the checkpointed run stretches the cosine instead of continuing from its end value.
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * fn(scheduler.last_epoch)
    scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(ckpt["rng"])
    adaptive_map = ckpt.get("adaptive_map")
    if adaptive_map is not None:  # the map and storages in force when it was saved
        apply_adapted(net, adaptive_map, cfg)
    return int(ckpt["epoch"]), list(ckpt["history"]), adaptive_map


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load weights into ``model`` from a state_dict file or a training checkpoint (``'model'``)."""
    state = load_torch_file(resolve_path(path))
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    model.load_state_dict(state)
