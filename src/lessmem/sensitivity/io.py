"""A compression map as a file: a ``compression`` config group file written from a menu's choice,
and read back."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

StorageRule = str | Mapping[str, str]


def write_map_yaml(mapping: Mapping[str, Any], path: str | Path, name: str | None = None,
                   comment: str | None = None, norm_storage: StorageRule = "native",
                   act_storage: StorageRule = "native", saved_storage: StorageRule = "native") -> Path:
    """Write ``mapping`` (pattern -> kernel or spec text such as ``"2/int4"``), the storages of
    BatchNorm and activation inputs and of saved-tensor regions as a compression config group file
    (``conf/compression/<name>.yaml``)."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "name": name or path.stem,
        "map": {str(k): _value(v) for k, v in mapping.items()},
        "map_file": None,
        "norm_storage": _rule(norm_storage),
        "act_storage": _rule(act_storage),
        "saved_storage": _rule(saved_storage),
        "exact_companions": True,
    }
    header = "".join(f"# {line}\n" for line in (comment or "").splitlines())
    path.write_text(header + yaml.safe_dump(body, sort_keys=False))
    return path


def read_map_yaml(path: str | Path) -> tuple[dict[str, Any], StorageRule, StorageRule, StorageRule]:
    """(map, norm_storage, act_storage, saved_storage) of a map file: one with ``map:`` and
    settings, or a bare ``pattern: kernel`` mapping (storages then native)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of pattern -> kernel")
    if isinstance(data.get("map"), dict):
        return (dict(data["map"]), data.get("norm_storage") or "native", data.get("act_storage") or "native",
                data.get("saved_storage") or "native")
    return dict(data), "native", "native", "native"


def _value(v: Any) -> int | str:
    return v if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _rule(rule: StorageRule) -> StorageRule:
    return rule if isinstance(rule, str) else {str(k): str(v) for k, v in rule.items()}
