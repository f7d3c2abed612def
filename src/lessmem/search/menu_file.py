"""The menu of a configured model: measured on fixed batches of its dataset (what
``lessmem-sensitivity`` writes and a search measures when given no menu file), its files, and the
map the knapsack picks from it."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from lessmem.core import CompressionPlan
from lessmem.experiment import (
    fixed_batches,
    load_checkpoint,
    model_spec,
    run,
    task_of,
    with_progress,
)
from lessmem.sensitivity import (
    CRITERIA,
    MenuOptions,
    MenuResult,
    ScoredPlan,
    measure_menu,
)


def measure_config_menu(cfg: DictConfig, menu: DictConfig, sampling: DictConfig) -> MenuResult:
    """Measure ``menu`` (kernels, storages, norm_storages, act_storages, saved_storages) for the
    model of the train config ``cfg`` with its task's loss, on ``sampling.batches`` fixed batches
    of ``sampling.batch_size`` from ``sampling.split``, on the weights being trained: from
    ``sampling.checkpoint``, or after ``sampling.warmup_steps`` stock training steps of ``cfg``
    (0: the seeded random init)."""
    options = MenuOptions.from_config(menu)  # a bad storage or kernel fails before any warm-up
    torch.manual_seed(int(cfg.get("seed", 0)))
    model = model_spec(cfg.model).build()
    weights = "random init"
    with tempfile.TemporaryDirectory(prefix="lessmem-warmup-") as tmp:
        checkpoint = sampling.get("checkpoint") or warm_up(cfg, int(sampling.get("warmup_steps") or 0), Path(tmp))
        if checkpoint:
            load_checkpoint(model, checkpoint)
            weights = (str(sampling.checkpoint) if sampling.get("checkpoint")
                       else f"stock, after {int(sampling.warmup_steps)} warm-up steps")
    device = "cuda" if cfg.get("device", "auto") in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    model.to(device).train()
    batches = fixed_batches(cfg.dataset, int(sampling.batches), int(sampling.batch_size), str(sampling.split),
                            int(cfg.get("seed", 0)))
    result = measure_menu(model, with_progress(batches, "menu", "batch"), options, task_of(cfg).criterion)
    result.meta.update({"model": str(cfg.model.name), "dataset": str(cfg.dataset.name),
                        "split": str(sampling.split), "weights": weights})
    return result


def warm_up(cfg: DictConfig, steps: int, out_dir: Path) -> Path | None:
    """The checkpoint of ``steps`` stock training steps of ``cfg`` (one epoch cut at ``steps``,
    its schedule over those steps), written in ``out_dir``; None for no steps."""
    if steps <= 0:
        return None
    warm = cfg.copy()
    with open_dict(warm):
        warm.compression.update({"name": "none", "map": {}, "map_file": None, "norm_storage": "native",
                                 "act_storage": "native", "saved_storage": "native", "exact_companions": None})
        warm.update({"epochs": 1, "max_steps_per_epoch": steps, "out_dir": str(out_dir), "resume": False,
                     "adaptive": {**warm.get("adaptive", {}), "every": 0}})
        warm.logger = {"name": "disabled"}
    run(warm)
    return out_dir / "checkpoint.pt"


def cached_menu(cfg: DictConfig, menu: DictConfig, sampling: DictConfig, out_dir: Path) -> MenuResult:
    """The menu measured once and kept in ``out_dir`` (menu.json), so a resumed search, and every
    worker of a shared one, sees the same numbers."""
    if (out_dir / "menu.json").is_file():
        return MenuResult.load(out_dir)
    # Workers started together all measure it (deterministic); the first rename wins.
    tmp_dir = out_dir.with_name(f".{out_dir.name}.{socket.gethostname()}.{os.getpid()}")
    result = measure_config_menu(cfg, menu, sampling)
    result.save(tmp_dir)
    try:
        os.rename(tmp_dir, out_dir)
    except OSError:  # another worker was first
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return MenuResult.load(out_dir)
    return result


def check_criterion(criterion: str) -> None:
    """Before minutes of measuring, not after."""
    if criterion not in CRITERIA:
        raise ValueError(f"unknown criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")


def write_menu_files(result: MenuResult, budget: float, criterion: str, out: Path, map_out: Path | None = None,
                     max_step_ratio: float = 1.0,
                     step_time: Callable[[CompressionPlan], float] | None = None) -> tuple[ScoredPlan, dict[str, Path]]:
    """menu.json / menu.csv / menu.png in ``out`` and the knapsack's map of least ``criterion``
    within ``budget`` (fraction of stock's saved bytes) as a compression config file; regions
    recomputed where the menu measured them and ``max_step_ratio`` allows (``MenuResult.make_map``).
    ``step_time``: the map's measured step time over stock's (``step_timer``), in its header and
    menu.json (the menu predicts the reruns alone)."""
    choice = result.make_map(budget, criterion, max_step_ratio=max_step_ratio)
    measured = step_time(choice.plan) if step_time is not None else None
    result.meta["chosen"] = {"budget": budget, "criterion": criterion, "score": choice.score,
                             **({"max_step_ratio": max_step_ratio} if max_step_ratio != 1.0 else {}),
                             **({"measured_step_ratio": measured} if measured is not None else {})}
    paths = result.save(out)
    model = result.meta.get("model", "model")
    timed = (f"; measured step {measured:.2f}x stock's (median of alternating steps on one batch of "
             f"{result.meta['batch_size']}, this machine)" if measured is not None else "")
    comment = (f"Generated by lessmem-sensitivity ({model}, {result.meta.get('weights')}): least {criterion} "
               f"within {budget} x stock saved bytes.\npredicted ratio {choice.score['ratio']:.3f}, grad_error "
               f"{choice.score['grad_error']:.4g}, mean cosine {choice.score['cosine']:.4f} "
               f"(batch {result.meta['batch_size']}){choice.reruns_note()}{timed}")
    paths["map"] = choice.plan.write(map_out or out / f"menu_{model}.yaml", comment=comment)
    return choice, paths
