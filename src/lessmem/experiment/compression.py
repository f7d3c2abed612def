"""A run's model as configured: built from ``cfg.model``, compressed by the ``compression`` group
resolved into one complete choice, and wrapped for several ranks (DDP) and ``torch.compile``.

The choice is the map, its label, and the settings it runs with (exact companions, norm / act /
saved storage), with a short hash. A map file is a complete choice: its ``name:`` labels the run,
and its own ``exact_companions`` / ``norm_storage`` / ``act_storage`` / ``saved_storage`` keys
(when present) win over the preset's. ``exact_companions: null`` (the ``none`` preset) means "on
whenever the map compresses a layer", so a map given on top of the stock preset never runs without
the 1-bit masks and compact max-pool by accident. A preset changed on the command line is labelled
by what ran: ``<preset>+<first 6 hex digits of the hash>``.

On the command line a map is one string, ``PATTERN:SPEC`` pairs joined by commas
(``'compression.map="layer1.*:4,*:2"'``): globs and dotted layer names need no quoting beyond the
shell's, and Hydra's dict grammar (which refuses both) is not involved.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from lessmem.core import compress, parse_spec
from lessmem.experiment.distributed import DistInfo
from lessmem.experiment.paths import conf_dir, resolve_path
from lessmem.models import build_model

FILE_SETTINGS = ("exact_companions", "norm_storage", "act_storage", "saved_storage")
MAP_FORM = 'compression.map="PATTERN:SPEC,PATTERN:SPEC" (e.g. \'compression.map="layer1.*:4,*:2"\')'


@dataclass(frozen=True)
class CompressionChoice:
    name: str  # the run's label: the preset's or map file's name (+ short hash when changed)
    map: dict[str, Any]
    exact_companions: bool
    norm_storage: Any  # "native" | "bf16" | "int8" | ... or {pattern: storage}
    source: str  # "config" or the map file's path
    act_storage: Any = "native"  # GELU / SiLU inputs, as norm_storage
    saved_storage: Any = "native"  # every other saved tensor inside matched modules ({module pattern: storage})
    given: str = ""  # what the user wrote, for errors: the preset, its changed entries, or the map file

    @property
    def digest(self) -> str:
        """10 hex digits of the map and its settings: equal choices, equal digests."""
        fields = {"map": self.map, "exact_companions": self.exact_companions, "norm_storage": self.norm_storage}
        for key in ("act_storage", "saved_storage"):  # runs from before these options keep their digests
            if getattr(self, key) != "native":
                fields[key] = getattr(self, key)
        text = json.dumps(fields, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    @property
    def is_stock(self) -> bool:
        """Nothing changes: every layer exact and every storage native (the model runs as stock)."""
        storages = (self.norm_storage, self.act_storage, self.saved_storage)
        return not _compresses(self.map) and all(s == "native" for s in storages)

    def apply(self, net: nn.Module, mapping: dict[str, Any] | None = None) -> None:
        """Compress ``net`` with ``mapping`` (default: this choice's map) and this choice's settings."""
        compress(net, self.map if mapping is None else mapping, norm_storage=self.norm_storage,
                 act_storage=self.act_storage, saved_storage=self.saved_storage,
                 exact_companions=self.exact_companions)

    def adapted(self, choice: Mapping[str, Any]) -> CompressionChoice:
        """This choice with an adaptive schedule's ``{"map", "norm_storage", "act_storage"}``. Exact
        companions are on whenever it compresses anything (as ``exact_companions: null`` means; the
        menu's bytes assume them), even on a run that started stock."""
        mapping = dict(choice["map"])
        lossy = any(choice[k] != "native" for k in ("norm_storage", "act_storage"))
        return replace(self, map=mapping, norm_storage=choice["norm_storage"], act_storage=choice["act_storage"],
                       exact_companions=self.exact_companions or lossy or _compresses(mapping))

    def record(self) -> dict[str, Any]:
        """What a run's metrics carry about its compression (tables and W&B label runs by it)."""
        return {"compression": self.name, "compression_hash": self.digest,
                "compression_source": self.source, "compression_map": self.map,
                "exact_companions": self.exact_companions, "norm_storage": self.norm_storage,
                "act_storage": self.act_storage, "saved_storage": self.saved_storage}


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig | ListConfig) else value


def parse_map_string(text: str) -> dict[str, Any]:
    """``"layer1.*:4,*:2/int4"`` -> ``{"layer1.*": 4, "*": "2/int4"}`` (order kept: first match wins;
    a bare kernel is a number, as in a YAML map, so equal maps hash equally). A JSON / YAML mapping
    (``'{"layer1.*": 4, "*": "2/int4"}'``) reads the same."""
    if text.lstrip().startswith("{"):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"compression.map={text!r} is not a valid JSON / YAML mapping: "
                             f"{' '.join(str(e).split())}; or write {MAP_FORM}") from e
        if not isinstance(data, dict):
            raise ValueError(f"compression.map={text!r} is not a mapping; write {MAP_FORM}")
        return _checked({str(k): v for k, v in data.items()}, f"compression.map={text!r}")
    mapping: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        pattern, colon, spec = item.rpartition(":")
        if not colon or not pattern.strip() or not spec.strip():
            raise ValueError(f"compression.map={text!r}: {item!r} is not PATTERN:SPEC; write {MAP_FORM}")
        spec = spec.strip()
        mapping[pattern.strip()] = int(spec) if spec.isdigit() else spec
    return _checked(mapping, f"compression.map={text!r}")


def _read_map_file(ccfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """(map, file settings incl. ``name``, path) of ``compression.map_file``."""
    path = resolve_path(ccfg["map_file"])
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
        if isinstance(value, dict) and "kernel" not in value:  # Hydra split a dotted name into keys
            raise ValueError(f"{source}: {pattern!r} maps to {value!r}: a dotted layer name given as "
                             f"compression.map.NAME=SPEC becomes nested keys; write {MAP_FORM}")
        try:
            parse_spec(str(pattern), value)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e
    return mapping


def _compresses(mapping: dict[str, Any]) -> bool:
    specs = [parse_spec(str(p), v) for p, v in mapping.items()]
    return any(not s.exact for s in specs)


def _config_map(ccfg: Mapping[str, Any]) -> dict[str, Any]:
    raw = _plain(ccfg.get("map") or {})
    if isinstance(raw, str):
        return parse_map_string(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"compression.map: expected a mapping of pattern -> kernel or {MAP_FORM}, got {raw!r}")
    return _checked(dict(raw), "compression.map")


def _unlabelled(ccfg: Mapping[str, Any]) -> CompressionChoice:
    settings: dict[str, Any] = {}
    if ccfg.get("map_file"):
        mapping, settings, path = _read_map_file(ccfg)
        mapping = _checked(mapping, f"compression.map_file {path}")
        name, source, given = str(settings.get("name") or path.stem), str(path), f"compression.map_file {path}"
    else:
        mapping = _config_map(ccfg)
        name, source = str(ccfg.get("name") or "custom"), "config"
        given = f"compression {name!r}"
    exact = settings.get("exact_companions", ccfg.get("exact_companions"))
    if exact is None:
        exact = _compresses(mapping)
    storages = {k: _plain(settings.get(k, ccfg.get(k, "native"))) for k in FILE_SETTINGS[1:]}
    return CompressionChoice(name=name, map=mapping, exact_companions=bool(exact), source=source, given=given,
                             **storages)


def _preset(name: str) -> CompressionChoice | None:
    """The stock ``conf/compression/<name>.yaml`` as a choice (None when there is no such preset)."""
    path = conf_dir() / "compression" / f"{name}.yaml"
    if not path.is_file():
        return None
    return _unlabelled(OmegaConf.to_container(OmegaConf.load(path), resolve=True))


def resolve_compression(ccfg: Mapping[str, Any]) -> CompressionChoice:
    """The complete choice of a ``compression`` group; every kernel is checked (ValueError). A
    preset changed on the command line is labelled ``<preset>+<hash6>`` and its errors name the
    entries the user changed."""
    choice = _unlabelled(ccfg)
    preset = None if ccfg.get("map_file") else _preset(choice.name)
    if preset is None or preset.digest == choice.digest:
        return choice
    changed = {k: v for k, v in choice.map.items() if preset.map.get(k) != v}
    given = (f"compression.map {changed!r} on top of preset {choice.name!r}" if changed
             else f"preset {choice.name!r} with changed settings")
    return replace(choice, name=f"{choice.name}+{choice.digest[:6]}", given=given)


def build_model_from_cfg(cfg: Mapping[str, Any]) -> nn.Module:
    """The model of a composed train config (``cfg.model``: name, num_classes, kwargs; its
    ``task`` is the run's, read by ``lessmem.experiment.task``)."""
    model_cfg = dict(_plain(cfg["model"]))
    name, num_classes = model_cfg.pop("name"), model_cfg.pop("num_classes")
    model_cfg.pop("task", None)
    return build_model(name, int(num_classes), **model_cfg)


def compress_model(model: nn.Module, choice: CompressionChoice, model_name: str) -> None:
    """Apply ``choice``; a map that does not fit the model is a ValueError naming what the user
    wrote (the preset, the entries changed on the command line, or the map file) and the model."""
    try:
        choice.apply(model)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{choice.given} does not fit model {model_name!r}: {e}") from e


def compress_as_configured(model: nn.Module, cfg: DictConfig) -> CompressionChoice:
    """Apply the configured compression choice and return it."""
    choice = resolve_compression(cfg.compression)
    compress_model(model, choice, str(cfg.model.name))
    return choice


def wrap_for_training(model: nn.Module, ddp: DistInfo, device: torch.device, *, sync_bn: bool,
                      compile_mode: str | None) -> tuple[nn.Module, nn.Module]:
    """(net, model): ``net`` is the module itself (optimizer, checkpoints, evaluation, grad
    cosine), ``model`` what a training step calls (DDP and/or compiled around ``net``).
    ``compile_mode``: None for no torch.compile, "default" or a torch.compile mode."""
    net = model
    if ddp.world_size > 1:
        if sync_bn:
            net = model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # Compressed layers are autograd Functions with ordinary parameters: DDP's hooks
        # all-reduce (average) their weight gradients like any other layer's.
        model = nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None)
    if compile_mode is not None:
        # Compressed layers are custom ops under torch.compile: traced, not graph breaks.
        model = torch.compile(model, mode=None if compile_mode == "default" else compile_mode)
    return net, model
