"""The ``compression`` config group: its pattern -> kernel map, checked, and applying a map
with the group's storage settings."""

from __future__ import annotations

from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from torch import nn

from lessmem.core import compress, parse_spec
from lessmem.experiment.paths import resolve_path


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
