"""Training state and checkpoints: what a run holds while it trains, where it is, saving that,
reading it back, restoring a run from it, and stopping cleanly on SIGINT / SIGTERM.

A checkpoint holds tensors and plain data only (numbers, strings, lists, tuples, dicts), so it
is read with ``torch.load(weights_only=True)``: loading a file never runs code from it. It is
written at epoch ends (``checkpoint_every``), every ``checkpoint_every_steps`` steps, and when a
signal stops the run; one written within an epoch carries the data position and the epoch's sums
so far, so ``resume=true`` continues that epoch as the uninterrupted run would have, bit for bit.
"""

from __future__ import annotations

import pickle
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

from lessmem.core import CompressionPlan, compress
from lessmem.experiment.distributed import all_reduce_sum
from lessmem.experiment.paths import resolve_path
from lessmem.experiment.runtime import atomic_torch_save, rng_state, set_rng_state

RESUME_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "rng", "history")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class TrainState:
    """What a training step changes: ``net`` is the module itself (optimizer, checkpoints,
    evaluation), ``model`` what a step calls (``net`` under DDP and/or torch.compile)."""

    net: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler


@dataclass
class Position:
    """Where a run is: ``epoch`` epochs done, ``step`` steps of the next one done, and that epoch's
    running sums (``partial``: lr at its start, the task's sums, grad cosines, seconds so far)."""

    epoch: int = 0
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    partial: dict[str, Any] = field(default_factory=dict)
    adaptive_plan: CompressionPlan | None = None  # the plan an adaptive schedule put in force


class Interrupted(BaseException):  # noqa: N818 (not an error: a requested stop, like KeyboardInterrupt)
    """A run stopped by SIGINT / SIGTERM after its checkpoint was written."""

    def __init__(self, signum: int, where: Position, steps: int, out_dir: Path) -> None:
        self.signum, self.exit_code, self.out_dir = signum, 128 + signum, out_dir
        self.name = signal.Signals(signum).name
        self.where = f"epoch {where.epoch + 1} step {where.step}/{steps}" if where.step else f"after epoch {where.epoch}"
        super().__init__(f"{self.name}: stopped {self.where}, checkpoint "
                         f"{out_dir / 'checkpoint.pt'}; continue with resume=true out_dir={out_dir}")


class StopSignals:
    """While a run trains, SIGINT and SIGTERM ask it to stop after the current step (a second
    one stops at once). Signal handlers belong to the main thread: elsewhere this does nothing."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            self.__exit__()
            raise KeyboardInterrupt
        self.signum = signum

    def requested(self, device: torch.device) -> int | None:
        """The signal to stop for; every rank agrees (the ranks must stop at the same step)."""
        anyone = all_reduce_sum([float(self.signum or 0)], device)[0]
        return (self.signum or int(signal.SIGTERM)) if anyone else None


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


def checkpoint_to_resume(path: Path, device: torch.device) -> dict[str, Any]:
    """The checkpoint ``resume=true`` continues from, read up front so a missing or unreadable one
    fails before anything is built."""
    if not path.exists():
        run_dir = path.parent
        if (run_dir / "config.yaml").exists():
            raise FileNotFoundError(
                f"resume=true but the run in {run_dir} stopped before its first checkpoint (no {path.name}); "
                "start it again without resume=true (checkpoint_every_steps=N also saves within an epoch)")
        raise FileNotFoundError(
            f"resume=true but there is no checkpoint at {path}: no run was started in {run_dir}; name the "
            "directory of the run to continue with out_dir=DIR (or hydra.run.dir=DIR)")
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
    for key in ("model", "compression", "memory_budget", "optimizer", "scheduler", "batch_size", "seed"):
        if key in saved and saved[key] != now.get(key):
            raise ValueError(f"resume: {key} differs from the checkpoint's ({saved[key]} vs {now.get(key)})")


@dataclass(frozen=True)
class Checkpoints:
    """Where a run's checkpoints go, with what they carry besides the training state."""

    path: Path
    memory: dict[str, Any]  # the run's memory measurement
    config: dict[str, Any]  # the resolved config (resume checks it against its own)
    budget: dict[str, Any] | None = None  # memory_budget's choice: {"plan": its to_dict, "record": the fit's figures}

    def save(self, state: TrainState, at: Position) -> None:
        """Everything ``resume=true`` needs to continue from ``at``, written atomically."""
        atomic_torch_save({
            "model": state.net.state_dict(), "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(),
            "epoch": at.epoch, "step": at.step, "partial": at.partial, "rng": rng_state(),
            "history": at.history, "memory": self.memory, "config": self.config,
            "adaptive_plan": None if at.adaptive_plan is None else at.adaptive_plan.to_dict(), "budget": self.budget,
        }, self.path)


def restore_checkpoint(ckpt: dict[str, Any], state: TrainState, config: dict[str, Any]) -> Position:
    """Put a run back where ``ckpt`` left it: weights, optimizer, schedule, scaler, RNG (with the
    rounding noise's counter), data position, and the adaptive plan in force."""
    check_compatible(ckpt.get("config", {}), config)
    state.net.load_state_dict(ckpt["model"])
    state.optimizer.load_state_dict(ckpt["optimizer"])
    state.scheduler.load_state_dict(ckpt["scheduler"])
    # Recompute the lr from the (possibly longer) schedule: resuming with more epochs than
    # the checkpointed run stretches the cosine instead of continuing from its end value.
    scheduler = state.scheduler
    for group, base, fn in zip(state.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * fn(scheduler.last_epoch)
    state.scaler.load_state_dict(ckpt["scaler"])
    set_rng_state(ckpt["rng"])
    adaptive_plan = ckpt.get("adaptive_plan")
    if adaptive_plan is not None:  # the plan in force when it was saved
        adaptive_plan = CompressionPlan.from_dict(adaptive_plan)
        compress(state.net, adaptive_plan)
    return Position(epoch=int(ckpt["epoch"]), step=int(ckpt.get("step", 0)), history=list(ckpt["history"]),
                    partial=dict(ckpt.get("partial") or {}), adaptive_plan=adaptive_plan)


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load weights into ``model`` from a state_dict file or a training checkpoint (``'model'``);
    ValueError (one line) when they do not fit it."""
    path = resolve_path(path)
    state = load_torch_file(path)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # missing / unexpected keys, other shapes: another model's weights
        raise ValueError(f"checkpoint {path} does not fit the model ({type(model).__name__}): {e}") from e
