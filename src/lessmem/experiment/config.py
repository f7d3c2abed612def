"""From a composed config to the objects a run needs: device, precision, compression map,
optimizer, scheduler. Also Hydra composition for the non-``@hydra.main`` entry points."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lessmem.core import compress, parse_spec
from lessmem.experiment.distributed import world_size
from lessmem.experiment.paths import conf_dir, resolve_path
from lessmem.models import build_model

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compose_config(overrides: Sequence[str], config_name: str = "train") -> Any:
    """Hydra compose of ``<conf_dir>/<config_name>.yaml`` with command-line style overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name, overrides=list(overrides))


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


def compression_map(ccfg: DictConfig) -> dict[str, Any]:
    """The pattern -> kernel map: ``compression.map_file`` (YAML with a top-level ``map:`` or a
    plain map) when set, else ``compression.map``. Every kernel is checked here (ValueError)."""
    if ccfg.get("map_file"):
        path = resolve_path(ccfg.map_file)
        source = f"compression.map_file {path}"
        if not path.is_file():
            raise FileNotFoundError(f"{source} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{source} is not valid YAML: {' '.join(str(e).split())}") from e
        if isinstance(data, dict) and isinstance(data.get("map"), dict):
            data = data["map"]
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of pattern -> kernel")
    else:
        source = "compression.map"
        raw = ccfg.get("map") or {}
        data = OmegaConf.to_container(raw) if isinstance(raw, DictConfig) else raw
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of pattern -> kernel, got {data!r}")
        data = dict(data)
    for pattern, value in data.items():
        try:
            parse_spec(str(pattern), value)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e
    return data


def compress_from_config(net: nn.Module, mapping: dict[str, Any], cfg: DictConfig) -> None:
    """Apply ``mapping`` with the config's norm storage and exact-companion settings."""
    compress(net, mapping, norm_storage=cfg.compression.get("norm_storage", "native"),
                     exact_companions=bool(cfg.compression.get("exact_companions", True)))


def build_optimizer(ocfg: DictConfig, params: Any) -> torch.optim.Optimizer:
    if ocfg.name == "sgd":
        return torch.optim.SGD(params, lr=ocfg.lr, momentum=ocfg.get("momentum", 0.0),
                               weight_decay=ocfg.get("weight_decay", 0.0),
                               nesterov=bool(ocfg.get("nesterov", False)))
    if ocfg.name == "adamw":
        return torch.optim.AdamW(params, lr=ocfg.lr, betas=tuple(ocfg.get("betas", (0.9, 0.999))),
                                 weight_decay=ocfg.get("weight_decay", 0.01))
    raise ValueError(f"unknown optimizer {ocfg.name!r}; available: sgd, adamw")


def build_scheduler(scfg: DictConfig, optimizer: torch.optim.Optimizer, epochs: int,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step schedule: linear warmup, then cosine / step / constant. The cosine horizon is
    ``epochs``, so resume with the same ``epochs`` to reproduce an uninterrupted run."""
    total, warmup = epochs * steps_per_epoch, int(scfg.get("warmup_epochs", 0) * steps_per_epoch)
    name = scfg.name
    if name not in ("cosine", "step", "none"):
        raise ValueError(f"unknown scheduler {name!r}; available: cosine, step, none")
    floor = float(scfg.get("min_lr_ratio", 0.0))
    milestones = [int(m) * steps_per_epoch for m in scfg.get("milestones", [])]
    gamma = float(scfg.get("gamma", 0.1))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if name == "cosine":
            t = (step - warmup) / max(1, total - warmup)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
        if name == "step":
            return gamma ** sum(step >= m for m in milestones)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@contextlib.contextmanager
def open_struct(cfg: DictConfig) -> Iterator[None]:
    """Allow new keys for a moment (configs from compose() are in struct mode)."""
    struct = OmegaConf.is_struct(cfg)
    OmegaConf.set_struct(cfg, False)
    try:
        yield
    finally:
        OmegaConf.set_struct(cfg, struct)


def build_model_from_cfg(cfg: DictConfig) -> nn.Module:
    """The model of a composed train config (``cfg.model``: name, num_classes, kwargs)."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    name, num_classes = model_cfg.pop("name"), model_cfg.pop("num_classes")
    return build_model(name, int(num_classes), **model_cfg)
