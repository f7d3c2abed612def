"""The ``compression`` config group resolved into one complete choice: the map, its name, and the
settings it runs with (exact companions, norm storage), with a short hash that labels the run.

A map file is a complete choice: its ``name:`` labels the run, and its own ``exact_companions`` /
``norm_storage`` / ``act_storage`` / ``saved_storage`` keys (when present) win over the preset's. ``exact_companions: null`` (the
``none`` preset) means "on whenever the map compresses a layer", so a map file given on top of
the stock preset never runs without the 1-bit masks and compact max-pool by accident.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from lessmem.core import compress, parse_spec
from lessmem.experiment.paths import resolve_path

FILE_SETTINGS = ("exact_companions", "norm_storage", "act_storage", "saved_storage")


@dataclass(frozen=True)
class CompressionChoice:
    name: str
    map: dict[str, Any]
    exact_companions: bool
    norm_storage: Any  # "native" | "bf16" | "int8" | ... or {pattern: storage}
    source: str  # "config" or the map file's path
    act_storage: Any = "native"  # GELU / SiLU inputs, as norm_storage
    saved_storage: Any = "native"  # every other saved tensor inside matched modules ({module pattern: storage})

    @property
    def digest(self) -> str:
        """10 hex digits of the map and its settings: equal choices, equal digests."""
        fields = {"map": self.map, "exact_companions": self.exact_companions, "norm_storage": self.norm_storage}
        for key in ("act_storage", "saved_storage"):  # runs from before these options keep their digests
            if getattr(self, key) != "native":
                fields[key] = getattr(self, key)
        text = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def apply(self, net: nn.Module, mapping: dict[str, Any] | None = None) -> None:
        """Compress ``net`` with ``mapping`` (default: this choice's map) and this choice's settings."""
        compress(net, self.map if mapping is None else mapping, norm_storage=self.norm_storage,
                 act_storage=self.act_storage, saved_storage=self.saved_storage,
                 exact_companions=self.exact_companions)

    def record(self) -> dict[str, Any]:
        """What a run's metrics carry about its compression (tables and W&B label runs by it)."""
        return {"compression": self.name, "compression_hash": self.digest,
                "compression_source": self.source, "compression_map": self.map,
                "exact_companions": self.exact_companions, "norm_storage": self.norm_storage,
                "act_storage": self.act_storage, "saved_storage": self.saved_storage}


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def _read_map_file(ccfg: DictConfig) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """(map, file settings incl. ``name``, path) of ``compression.map_file``."""
    path = resolve_path(ccfg.map_file)
    source = f"compression.map_file {path}"
    if not path.is_file():
        raise FileNotFoundError(f"{source} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{source} is not valid YAML: {' '.join(str(e).split())}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of pattern -> kernel")
    if isinstance(data.get("map"), dict):  # a file with a header: name, settings, map
        settings = {k: data[k] for k in ("name", *FILE_SETTINGS) if k in data}
        return dict(data["map"]), settings, path
    return dict(data), {}, path


def _checked(mapping: dict[str, Any], source: str) -> dict[str, Any]:
    for pattern, value in mapping.items():
        try:
            parse_spec(str(pattern), value)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e
    return mapping


def _compresses(mapping: dict[str, Any]) -> bool:
    specs = [parse_spec(str(p), v) for p, v in mapping.items()]
    return any(not s.exact for s in specs)


def resolve_compression(ccfg: DictConfig) -> CompressionChoice:
    """The complete choice of a ``compression`` group; every kernel is checked (ValueError)."""
    settings: dict[str, Any] = {}
    if ccfg.get("map_file"):
        mapping, settings, path = _read_map_file(ccfg)
        mapping = _checked(mapping, f"compression.map_file {path}")
        name, source = str(settings.get("name") or path.stem), str(path)
    else:
        raw = _plain(ccfg.get("map") or {})
        if not isinstance(raw, dict):
            raise ValueError(f"compression.map: expected a mapping of pattern -> kernel, got {raw!r}")
        mapping = _checked(dict(raw), "compression.map")
        name, source = str(ccfg.get("name") or "custom"), "config"
    exact = settings.get("exact_companions", ccfg.get("exact_companions"))
    if exact is None:
        exact = _compresses(mapping)
    norm_storage = _plain(settings.get("norm_storage", ccfg.get("norm_storage", "native")))
    act_storage = _plain(settings.get("act_storage", ccfg.get("act_storage", "native")))
    saved_storage = _plain(settings.get("saved_storage", ccfg.get("saved_storage", "native")))
    return CompressionChoice(name=name, map=mapping, exact_companions=bool(exact), norm_storage=norm_storage,
                             source=source, act_storage=act_storage, saved_storage=saved_storage)


def apply_adapted(net: nn.Module, adapted: Mapping[str, Any], cfg: DictConfig) -> None:
    """Apply an adaptive schedule's choice (``{"map", "norm_storage", "act_storage"}``) with the
    rest of the run's compression settings. Exact companions are on whenever the choice compresses
    anything (as ``exact_companions: null`` means; the menu's bytes assume them), even on a run
    that started stock."""
    base = resolve_compression(cfg.compression)
    mapping = dict(adapted["map"])
    lossy = any(adapted[k] != "native" for k in ("norm_storage", "act_storage"))
    replace(base, map=mapping, norm_storage=adapted["norm_storage"], act_storage=adapted["act_storage"],
            exact_companions=base.exact_companions or lossy or _compresses(mapping)).apply(net)
