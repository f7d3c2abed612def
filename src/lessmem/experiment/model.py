"""A run's model: built from ``cfg.model``, compressed per ``cfg.compression``, wrapped for
several ranks (DDP) and ``torch.compile``."""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lessmem.experiment.compression import CompressionChoice, resolve_compression
from lessmem.experiment.distributed import DistInfo
from lessmem.models import build_model


def build_model_from_cfg(cfg: DictConfig) -> nn.Module:
    """The model of a composed train config (``cfg.model``: name, num_classes, kwargs; its
    ``task`` is the run's, read by ``lessmem.experiment.task``)."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    name, num_classes = model_cfg.pop("name"), model_cfg.pop("num_classes")
    model_cfg.pop("task", None)
    return build_model(name, int(num_classes), **model_cfg)


def compress_as_configured(model: nn.Module, cfg: DictConfig) -> CompressionChoice:
    """Apply the configured compression choice and return it; a map that does not fit the model
    is a ValueError naming both."""
    choice = resolve_compression(cfg.compression)
    try:
        choice.apply(model)
    except (ValueError, TypeError) as e:
        raise ValueError(f"compression {choice.name!r} does not fit model {cfg.model.name!r}: {e}") from e
    return choice


def wrap_for_training(model: nn.Module, cfg: DictConfig, ddp: DistInfo,
                      device: torch.device) -> tuple[nn.Module, nn.Module]:
    """(net, model): ``net`` is the module itself (optimizer, checkpoints, evaluation, grad
    cosine), ``model`` what a training step calls (DDP and/or compiled around ``net``)."""
    net = model
    if ddp.world_size > 1:
        if cfg.get("sync_bn"):
            net = model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # Compressed layers are autograd Functions with ordinary parameters: DDP's hooks
        # all-reduce (average) their weight gradients like any other layer's.
        model = nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.get("compile"):
        # Compressed layers are custom ops under torch.compile: traced, not graph breaks.
        model = torch.compile(model, mode=cfg.get("compile_mode") or None)
    return net, model
