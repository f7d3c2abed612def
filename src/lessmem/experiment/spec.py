"""A run's settings resolved once from the composed config (``resolve_run``): where it runs
(device, ranks, output directory), what it trains (model, data, task, compression plan), how
(optimizer and schedule, precision, checkpoints, adaptive schedule, logging). Everything is checked
before anything is built, and the rest of a run reads this frozen spec; the resolved config itself
(``config``) is only recorded (config.yaml, checkpoints, the tracker), never read again."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lessmem.core import CompressionPlan
from lessmem.experiment.checkpoint import load_checkpoint
from lessmem.experiment.compression import compression_given, resolve_compression
from lessmem.experiment.data import build_loaders, fixed_batches
from lessmem.experiment.distributed import DistInfo, broadcast_object, setup_distributed
from lessmem.experiment.paths import open_struct, resolve_path
from lessmem.experiment.runtime import resolve_device, validate
from lessmem.experiment.task import Task, task_of
from lessmem.models import build_model, with_lora
from lessmem.sensitivity import DEFAULT_CRITERION, MenuOptions


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_classes: int
    options: dict[str, Any]  # the builder's other keyword arguments (the ``model`` group's other keys)
    init_checkpoint: Path | None = None  # weights loaded as built (a run's checkpoint.pt), before LoRA
    lora: dict[str, Any] | None = None  # peft.LoraConfig's arguments: the adapters train, nothing else

    def build(self) -> nn.Module:
        model = build_model(self.name, self.num_classes, **self.options)
        if self.init_checkpoint is not None:
            load_checkpoint(model, self.init_checkpoint)
        return model if self.lora is None else with_lora(model, self.lora)


@dataclass(frozen=True)
class DataSpec:
    name: str
    group: dict[str, Any]  # the ``dataset`` group, as ``lessmem.experiment.data`` reads it
    batch_size: int  # per rank
    eval_batch_size: int
    memory_batch: int  # the batch of the saved-bytes measurement
    max_steps_per_epoch: int | None

    def loaders(self, seed: int, ddp: DistInfo) -> tuple[Any, Any]:
        return build_loaders(self.group, self.batch_size, self.eval_batch_size, seed, self.max_steps_per_epoch,
                             rank=ddp.rank, world_size=ddp.world_size)

    def probe(self, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first un-augmented training batch of ``seed`` (what ``lessmem-sensitivity`` measures
        on): the adaptive schedule's probe, the same on every rank and never a validation batch."""
        return fixed_batches(self.group, 1, size, "train", seed)[0]


@dataclass(frozen=True)
class OptimSpec:
    optimizer: dict[str, Any]  # the ``optimizer`` group: its ``_target_`` and arguments
    scheduler: dict[str, Any]  # the ``scheduler`` group, likewise

    def optimizer_for(self, params: Any) -> torch.optim.Optimizer:
        return instantiate(self.optimizer, _convert_="all")(params)

    def schedule(self, optimizer: torch.optim.Optimizer, epochs: int,
                 steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
        return instantiate(self.scheduler, _convert_="all")(optimizer, epochs=epochs, steps_per_epoch=steps_per_epoch)


@dataclass(frozen=True)
class AdaptiveSpec:
    """Re-choose the plan every ``every`` epochs (0: never) from epoch ``start`` on by the menu's
    knapsack within ``budget``."""

    every: int
    start: int
    budget: float  # total saved bytes, fraction of stock's
    probe_batch: int
    criterion: str
    menu: MenuOptions

    def due(self, epoch: int) -> bool:
        """Whether the plan is re-chosen before ``epoch``."""
        return self.every > 0 and epoch >= self.start and (epoch - self.start) % self.every == 0


@dataclass(frozen=True)
class LogSpec:
    logger: dict[str, Any]  # the ``logger`` group (wandb, csv, disabled)
    every_steps: int  # without a terminal: a progress line every N steps (0: none)


@dataclass(frozen=True)
class RunSpec:
    config: dict[str, Any]  # the whole config, resolved: recorded, never read
    out_dir: Path
    device: torch.device
    ddp: DistInfo
    sync_bn: bool
    task: Task
    model: ModelSpec
    data: DataSpec
    optim: OptimSpec
    plan: CompressionPlan
    plan_given: str  # what the user wrote for it (a preset, its changed entries, a map file): errors name it
    memory_budget: str | None  # e.g. "6GiB": the plan comes from lessmem.fit at the batch size
    fidelity: str  # the options lessmem.fit may use for memory_budget: exact | lossy | auto
    budget_step_ratio: float  # memory_budget's time allowance: lessmem.fit's max_step_ratio
    adaptive: AdaptiveSpec
    log: LogSpec
    precision: str
    seed: int
    epochs: int
    channels_last: bool
    compile_mode: str | None  # None: eager; "default" or a torch.compile mode
    grad_cosine_every: int  # steps; 0: off
    checkpoint_every: int  # epochs
    checkpoint_every_steps: int  # 0: only at epoch ends
    resume: bool
    coverage: bool

    @property
    def checkpoint_path(self) -> Path:
        return self.out_dir / "checkpoint.pt"

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    @property
    def label(self) -> str:
        return f"{self.model.name} / {self.plan.label}"


def model_spec(model_cfg: Mapping[str, Any]) -> ModelSpec:
    """The ``model`` group as a spec (name, num_classes, ``init_checkpoint``, ``lora``, the builder's
    keyword arguments; its ``task`` is the run's, read by ``lessmem.experiment.task``)."""
    options = dict(OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else model_cfg)
    name, num_classes = options.pop("name"), options.pop("num_classes")
    options.pop("task", None)
    init, lora = options.pop("init_checkpoint", None), options.pop("lora", None)
    return ModelSpec(str(name), int(num_classes), options,
                     init_checkpoint=None if init is None else existing_checkpoint(str(init)),
                     lora=None if lora is None else dict(lora))


def existing_checkpoint(given: str) -> Path:
    """``model.init_checkpoint`` resolved, checked before anything is built."""
    path = resolve_path(given)
    if not path.is_file():
        raise FileNotFoundError(
            f"model.init_checkpoint: no checkpoint at {path}; train the base model first (experiment=lora_quick's: "
            f"lessmem-train experiment=lm_quick hydra.run.dir={Path(given).parent}) or set "
            "model.init_checkpoint=PATH to a run's checkpoint.pt")
    return path


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
    plan, plan_given = resolve_compression(cfg.compression), compression_given(cfg.compression)
    task = task_of(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = OmegaConf.to_container(cfg, resolve=True)
    steps = cfg.get("max_steps_per_epoch")
    acfg = dict(config.get("adaptive") or {})
    return RunSpec(
        config=config, out_dir=out_dir, device=device, ddp=ddp, sync_bn=bool(cfg.get("sync_bn")), task=task,
        model=model_spec(config["model"]),
        data=DataSpec(str(config["dataset"]["name"]), dict(config["dataset"]), batch_size=int(cfg.batch_size),
                      eval_batch_size=int(cfg.eval_batch_size), memory_batch=int(cfg.memory_batch),
                      max_steps_per_epoch=None if steps is None else int(steps)),
        optim=OptimSpec(dict(config["optimizer"]), dict(config["scheduler"])),
        plan=plan, plan_given=plan_given,
        memory_budget=None if cfg.get("memory_budget") is None else str(cfg.memory_budget),
        fidelity=str(cfg.get("fidelity") or "lossy"), budget_step_ratio=float(cfg.budget_step_ratio),
        adaptive=AdaptiveSpec(every=int(acfg.get("every") or 0), start=int(acfg.get("start") or 0),
                              budget=float(acfg.get("budget", 1.0)),
                              probe_batch=int(acfg.get("probe_batch", 32)),
                              criterion=str(acfg.get("criterion") or DEFAULT_CRITERION),
                              menu=MenuOptions.from_config(acfg)),
        log=LogSpec(dict(config.get("logger") or {}), every_steps=int(cfg.get("log_every_steps") or 0)),
        precision=str(cfg.precision), seed=int(cfg.seed), epochs=int(cfg.epochs),
        channels_last=bool(cfg.get("channels_last")),
        compile_mode=(str(cfg.get("compile_mode") or "default")) if cfg.get("compile") else None,
        grad_cosine_every=int(cfg.get("grad_cosine_every") or 0),
        checkpoint_every=int(cfg.checkpoint_every),
        checkpoint_every_steps=int(cfg.get("checkpoint_every_steps") or 0),
        resume=bool(cfg.resume), coverage=bool(cfg.get("coverage")),
    )
