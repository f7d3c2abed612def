"""A run's settings resolved once from the composed config: where it runs (device, ranks, output
directory), what it trains (task, compression choice) and how (precision, schedule, checkpoints,
progress). ``resolve_run`` checks everything before anything is built; the rest of a run reads
this frozen spec instead of the config."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lessmem.experiment.compression import CompressionChoice, resolve_compression
from lessmem.experiment.distributed import DistInfo, broadcast_object, setup_distributed
from lessmem.experiment.paths import open_struct
from lessmem.experiment.runtime import resolve_device, validate
from lessmem.experiment.task import Task, task_of


@dataclass(frozen=True)
class RunSpec:
    config: dict[str, Any]  # the whole config, resolved (config.yaml, checkpoints, W&B)
    out_dir: Path
    device: torch.device
    ddp: DistInfo
    task: Task
    choice: CompressionChoice
    precision: str
    seed: int
    epochs: int
    batch_size: int
    eval_batch_size: int
    memory_batch: int
    max_steps_per_epoch: int | None
    channels_last: bool
    compile_mode: str | None  # None: eager; "default" or a torch.compile mode
    sync_bn: bool
    grad_cosine_every: int  # steps; 0: off
    checkpoint_every: int  # epochs
    checkpoint_every_steps: int  # 0: only at epoch ends
    log_every_steps: int  # without a terminal: a progress line every N steps (0: none)
    bars: bool  # tqdm bars (main process with a terminal)
    resume: bool
    coverage: bool
    adaptive: dict[str, Any]
    memory_budget: str | None  # e.g. "6GiB": the choice comes from lessmem.fit at batch_size

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / "checkpoint.pt"

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    @property
    def adapt_every(self) -> int:
        return int(self.adaptive.get("every") or 0)

    @property
    def label(self) -> str:
        return f"{self.config['model']['name']} / {self.choice.name}"


def default_out_dir() -> Path:
    return Path("outputs") / datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def resolve_run(cfg: DictConfig) -> RunSpec:
    """The spec of ``cfg``; joins the process group under torchrun and creates the output directory
    (``cfg.out_dir``, else ``outputs/<date>/<time>``; rank 0's, since Hydra's run dir may differ by
    a second between ranks)."""
    cfg = copy.deepcopy(cfg)
    device = resolve_device(str(cfg.device))
    # Under torchrun: batch_size is per rank (global batch = world_size x batch_size), each rank
    # trains on its shard of every global batch, rank 0 writes files and talks to W&B.
    ddp, device = setup_distributed(cfg, device)
    out_dir = Path(broadcast_object(str(Path(cfg.get("out_dir") or default_out_dir()).resolve())))
    with open_struct(cfg):
        cfg.out_dir = str(out_dir)
    validate(cfg, device)
    choice = resolve_compression(cfg.compression)
    task = task_of(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = OmegaConf.to_container(cfg, resolve=True)
    steps = cfg.get("max_steps_per_epoch")
    return RunSpec(
        config=config, out_dir=out_dir, device=device, ddp=ddp, task=task, choice=choice,
        precision=str(cfg.precision), seed=int(cfg.seed), epochs=int(cfg.epochs),
        batch_size=int(cfg.batch_size), eval_batch_size=int(cfg.eval_batch_size),
        memory_batch=int(cfg.memory_batch), max_steps_per_epoch=None if steps is None else int(steps),
        channels_last=bool(cfg.get("channels_last")),
        compile_mode=(str(cfg.get("compile_mode") or "default")) if cfg.get("compile") else None,
        sync_bn=bool(cfg.get("sync_bn")), grad_cosine_every=int(cfg.get("grad_cosine_every") or 0),
        checkpoint_every=int(cfg.checkpoint_every),
        checkpoint_every_steps=int(cfg.get("checkpoint_every_steps") or 0),
        log_every_steps=int(cfg.get("log_every_steps") or 0),
        bars=ddp.is_main and sys.stderr.isatty(),
        resume=bool(cfg.resume), coverage=bool(cfg.get("coverage")),
        adaptive=dict(config.get("adaptive") or {}),
        memory_budget=None if cfg.get("memory_budget") is None else str(cfg.memory_budget),
    )
