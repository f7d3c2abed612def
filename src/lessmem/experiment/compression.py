"""A run's model as configured: built from ``cfg.model``, compressed by the ``compression`` group
resolved into one ``CompressionPlan``, and wrapped for several ranks (DDP) and ``torch.compile``.

A map file is a complete plan: its ``name:`` labels the run, and its own ``exact_companions`` /
``norm_storage`` / ``act_storage`` / ``saved_storage`` keys (when present) win over the preset's.
``exact_companions: null`` (the ``none`` preset) means "on whenever the map compresses a layer", so
a map given on top of the stock preset never runs without the 1-bit masks and compact max-pool by
accident. A preset changed on the command line is labelled by what ran: ``<preset>+<first 6 hex
digits of the digest>``.

On the command line a map is one string, ``PATTERN:SPEC`` pairs joined by commas
(``'compression.map="layer1.*:4,*:2"'``): globs and dotted layer names need no quoting beyond the
shell's, and Hydra's dict grammar (which refuses both) is not involved.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

from lessmem.core import STORAGE_SETTINGS, CompressionPlan, compress, parse_spec
from lessmem.experiment.distributed import DistInfo
from lessmem.experiment.paths import conf_dir, resolve_path

MAP_FORM = 'compression.map="PATTERN:SPEC,PATTERN:SPEC" (e.g. \'compression.map="layer1.*:4,*:2"\')'


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


def _config_map(ccfg: Mapping[str, Any]) -> dict[str, Any]:
    raw = _plain(ccfg.get("map") or {})
    if isinstance(raw, str):
        return parse_map_string(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"compression.map: expected a mapping of pattern -> kernel or {MAP_FORM}, got {raw!r}")
    return _checked(dict(raw), "compression.map")


def _unlabelled(ccfg: Mapping[str, Any]) -> tuple[CompressionPlan, str]:
    settings = {k: _plain(ccfg.get(k)) for k in ("exact_companions", *STORAGE_SETTINGS) if ccfg.get(k) is not None}
    if ccfg.get("map_file"):
        path = resolve_path(ccfg["map_file"])
        try:
            return CompressionPlan.read(path, defaults=settings), f"compression.map_file {path}"
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"compression.map_file: {e}") from e
    name = str(ccfg.get("name") or "custom")
    try:
        plan = CompressionPlan(_config_map(ccfg), **{k: v for k, v in settings.items() if k != "exact_companions"},
                               exact_companions=settings.get("exact_companions"), name=name, source="config")
    except ValueError as e:
        raise ValueError(f"compression {name!r}: {e}") from e
    return plan, f"compression {name!r}"


def _preset(name: str) -> CompressionPlan | None:
    """The stock ``conf/compression/<name>.yaml`` as a plan (None when there is no such preset)."""
    path = conf_dir() / "compression" / f"{name}.yaml"
    if not path.is_file():
        return None
    return _unlabelled(OmegaConf.to_container(OmegaConf.load(path), resolve=True))[0]


def resolve_compression(ccfg: Mapping[str, Any]) -> CompressionPlan:
    """The plan of a ``compression`` group; every kernel and storage is checked (ValueError). A
    preset changed on the command line is labelled ``<preset>+<digest6>``."""
    plan, _ = _unlabelled(ccfg)
    preset = None if ccfg.get("map_file") else _preset(plan.name)
    if preset is None or preset.digest == plan.digest:
        return plan
    return plan.replace(name=f"{plan.name}+{plan.digest[:6]}")


def compression_given(ccfg: Mapping[str, Any]) -> str:
    """What the user wrote for a ``compression`` group, as errors name it: the preset, the entries
    changed on top of it, or the map file."""
    plan, given = _unlabelled(ccfg)
    preset = None if ccfg.get("map_file") else _preset(plan.name)
    if preset is None or preset.digest == plan.digest:
        return given
    changed = {k: v for k, v in plan.map.items() if preset.map.get(k) != v}
    return (f"compression.map {changed!r} on top of preset {plan.name!r}" if changed
            else f"preset {plan.name!r} with changed settings")


def compress_model(model: nn.Module, plan: CompressionPlan, given: str, model_name: str) -> None:
    """Apply ``plan``; one that does not fit the model is a ValueError naming what the user wrote
    (``given``: the preset, the entries changed on the command line, or the map file) and the model."""
    try:
        compress(model, plan)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{given} does not fit model {model_name!r}: {e}") from e


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
