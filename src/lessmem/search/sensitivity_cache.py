"""The study's sensitivity: computed once on fixed real batches and cached next to the study."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch
from omegaconf import DictConfig

from lessmem.experiment import build_model_from_cfg, fixed_batches, load_checkpoint, task_of
from lessmem.sensitivity import SensitivityResult, sensitivity


def study_sensitivity(sweep: DictConfig, base: DictConfig, out_dir: Path) -> SensitivityResult:
    """Computed once per study and cached next to it, so resumed trials see the same numbers."""
    cache = out_dir / "sensitivity" / "sensitivity.json"
    if cache.exists():
        return SensitivityResult.load(cache)
    # Workers started together all compute it (deterministic); the first rename wins.
    final_dir = cache.parent
    tmp_dir = final_dir.with_name(f".sensitivity.{socket.gethostname()}.{os.getpid()}")
    opts = sweep.sensitivity
    torch.manual_seed(int(base.get("seed", 0)))
    model = build_model_from_cfg(base)
    if opts.get("checkpoint"):
        load_checkpoint(model, opts.checkpoint)
    batches = fixed_batches(base, int(opts.batches), int(opts.batch_size), str(opts.split), int(base.get("seed", 0)))
    result = sensitivity(model.train(), batches, list(sweep.kernels), task_of(base).criterion, progress=True)
    result.meta.update({"model": str(base.model.name), "dataset": str(base.dataset.name),
                        "batch_size": int(opts.batch_size), "weights": str(opts.get("checkpoint") or "random init")})
    result.save(tmp_dir)
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:  # another worker was first
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return SensitivityResult.load(cache)
    return result
