"""A compression choice as one value (``CompressionPlan``): the per-layer map and the settings it
runs with, a stable digest and label, and its file form. Every chooser (the menu's knapsack,
``lessmem.fit``, a search trial, the adaptive schedule, a run's ``compression`` group) hands one
of these to ``lessmem.compress``; a result that adds figures (a score, peaks) holds one beside them.

A plan file is YAML: ``name``, ``map`` (pattern -> kernel or spec text) and the settings, as a
``conf/compression/<name>.yaml`` group file; a bare ``pattern: kernel`` mapping reads as a plan
with native storages. ``CompressionPlan.read`` / ``write`` are the one reader and writer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from lessmem.core.spec import FROM_NORM, parse_spec
from lessmem.core.storage import check_storage

StorageRule = str | Mapping[str, str]  # one storage for every layer it reaches, or {pattern: storage}
# A norm_storage value besides the storages: the input kept as it is (exact) by lessmem's BatchNorm, whose
# backward writes the input gradient in batch slices over the incoming one (``ops.batchnorm``)
CHUNKED = "chunked"
STORAGE_SETTINGS = ("norm_storage", "act_storage", "saved_storage")
FILE_SETTINGS = ("exact_companions", *STORAGE_SETTINGS, "recompute")


@dataclass(frozen=True)
class CompressionPlan:
    """What a model keeps for backward, everywhere: checked when made (ValueError naming the entry).

    map: ordered ``{fnmatch pattern on module names: kernel | spec}``, first match wins
        (``lessmem.compress`` documents the values).
    norm_storage / act_storage / saved_storage: BatchNorm2d inputs, GELU / SiLU inputs and every
        other tensor saved inside the matched modules: one storage or ``{pattern: storage}``
        (norm_storage also ``CHUNKED``: exact, with a lower backward peak).
    exact_companions: 1-bit ReLU masks, uint8 max-pool indices and recomputed activations (exact).
        ``None`` when made: on whenever the plan compresses anything.
    recompute: module-name patterns of regions that keep only their inputs and rerun their forward
        in backward (``ops.recomputed_region``; exact). A module inside a matched one is its region's.
    name, source: the plan's label and where it came from (a file, ``config``, a budget); neither
        enters the digest.
    """

    map: Mapping[str, Any] = field(default_factory=dict)
    norm_storage: StorageRule = "native"
    act_storage: StorageRule = "native"
    saved_storage: StorageRule = "native"
    exact_companions: bool | None = True
    recompute: tuple[str, ...] = ()
    name: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        mapping = {str(p): v for p, v in self.map.items()}
        for pattern, value in mapping.items():
            parse_spec(pattern, value)
        object.__setattr__(self, "map", mapping)
        for key in STORAGE_SETTINGS:
            rule = getattr(self, key)
            rule = str(rule) if isinstance(rule, str) else {str(p): str(s) for p, s in rule.items()}
            for storage in [rule] if isinstance(rule, str) else rule.values():
                check_setting(key, storage)
            object.__setattr__(self, key, rule)
        if isinstance(self.recompute, str):
            raise ValueError(f"recompute: a list of module-name patterns, not the string {self.recompute!r}")
        object.__setattr__(self, "recompute", tuple(str(p) for p in self.recompute))
        if "" in self.recompute:
            raise ValueError("recompute: '' is the model itself; name the regions (e.g. 'layer*.*')")
        if self.exact_companions is None:
            object.__setattr__(self, "exact_companions", self.compresses)

    @property
    def compresses(self) -> bool:
        """Some layer keeps less than stock (a kernel above 1, a storage, ``from_bn``, a recomputed region)."""
        return bool(self.recompute) or any(not parse_spec(p, v).exact for p, v in self.map.items())

    @property
    def lossless(self) -> bool:
        """Every gradient is stock's to float rounding: exact layers (``from_bn`` rebuilding from an
        exact BatchNorm input counts), native or chunked norm inputs, native storages; recomputed
        regions and exact companions are exact."""
        exact_norms = isinstance(self.norm_storage, str) and self.norm_storage in ("native", CHUNKED)
        return exact_norms and all(getattr(self, k) == "native" for k in ("act_storage", "saved_storage")) and all(
            parse_spec(p, v).kernel == (1, 1) and parse_spec(p, v).storage in ("native", FROM_NORM)
            for p, v in self.map.items())

    @property
    def is_stock(self) -> bool:
        """Nothing changes: every layer exact and every storage native (the model runs as stock)."""
        return not self.compresses and all(getattr(self, k) == "native" for k in STORAGE_SETTINGS)

    @property
    def digest(self) -> str:
        """10 hex digits of the map and its settings: equal plans, equal digests."""
        parts: dict[str, Any] = {"map": self.map, "exact_companions": self.exact_companions,
                                 "norm_storage": self.norm_storage}
        for key in ("act_storage", "saved_storage"):  # plans from before these settings keep their digests
            if getattr(self, key) != "native":
                parts[key] = getattr(self, key)
        if self.recompute:
            parts["recompute"] = list(self.recompute)
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:10]

    @property
    def label(self) -> str:
        return self.name or f"plan-{self.digest[:6]}"

    def replace(self, **changes: Any) -> CompressionPlan:
        return replace(self, **changes)

    def record(self) -> dict[str, Any]:
        """What a run's metrics carry about its compression (tables and W&B label runs by it)."""
        return {"compression": self.label, "compression_hash": self.digest, "compression_source": self.source,
                "compression_map": self.map, "exact_companions": self.exact_companions,
                "norm_storage": self.norm_storage, "act_storage": self.act_storage,
                "saved_storage": self.saved_storage, **({"recompute": list(self.recompute)} if self.recompute else {})}

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompressionPlan:
        """A plan from its ``to_dict`` (or any subset of its fields; the rest default)."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"a compression plan has no field(s) {sorted(unknown)}; fields: {sorted(known)}")
        return cls(**dict(data))

    # ---- files --------------------------------------------------------------------------------

    def write(self, path: str | Path, comment: str | None = None) -> Path:
        """Write the plan as a ``compression`` config group file (named ``name`` or the file's stem);
        ``comment`` becomes its leading ``#`` lines."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"name": self.name or path.stem, "map": {p: _file_value(v) for p, v in self.map.items()}, "map_file": None,
                **{k: getattr(self, k) for k in STORAGE_SETTINGS}, "exact_companions": self.exact_companions,
                **({"recompute": list(self.recompute)} if self.recompute else {})}
        header = "".join(f"# {line}\n" for line in (comment or "").splitlines())
        path.write_text(header + yaml.safe_dump(body, sort_keys=False))
        return path

    @classmethod
    def read(cls, path: str | Path, defaults: Mapping[str, Any] | None = None) -> CompressionPlan:
        """The plan in a file: one with ``map:`` and settings, or a bare ``pattern: kernel`` mapping.
        Settings the file lacks come from ``defaults`` (else native storages, and exact companions
        on whenever the map compresses); the name is the file's ``name:`` or its stem. Errors name
        the file."""
        path = Path(path)
        where = f"map file {path}"
        if not path.is_file():
            raise FileNotFoundError(f"{where} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{where} is not valid YAML: {' '.join(str(e).split())}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a mapping of pattern -> kernel")
        settings = dict(defaults or {})
        if isinstance(data.get("map"), dict):  # a file with a header: name, settings, map
            settings |= {k: data[k] for k in FILE_SETTINGS if data.get(k) is not None}
            mapping, name = data["map"], data.get("name")
        else:
            mapping, name = data, None
        storages = {k: settings[k] for k in STORAGE_SETTINGS if settings.get(k) is not None}
        try:
            return cls(mapping, **storages, exact_companions=settings.get("exact_companions"),
                       recompute=tuple(settings.get("recompute") or ()),
                       name=str(name or path.stem), source=str(path))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e


def check_setting(setting: str, storage: str) -> str:
    """``storage`` if the storage setting ``setting`` takes it (a storage; for norm_storage also
    ``CHUNKED``), else a ValueError naming the setting."""
    if setting == "norm_storage" and storage == CHUNKED:
        return storage
    try:
        return check_storage(storage)
    except ValueError as e:
        exact = f", or {CHUNKED!r} (exact, lessmem's sliced backward)" if setting == "norm_storage" else ""
        raise ValueError(f"{setting}: {e}{exact}") from None


def _file_value(value: Any) -> int | str:
    return value if isinstance(value, int) and not isinstance(value, bool) else str(value)
