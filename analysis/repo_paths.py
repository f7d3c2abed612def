"""Paths in published results, relative to the repository root: the tracked files read the same in
any checkout and name no directory of the machine that ran them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def relative_to_repo(value: Any, root: Path = REPO) -> Any:
    """``value`` with ``<root>/`` cut from every string in it (dicts and lists walked, keys too):
    a run's ``out_dir``, a map file's header, a search's ``best_map``."""
    prefix = f"{root}/"
    if isinstance(value, str):
        return value.replace(prefix, "")
    if isinstance(value, dict):
        return {relative_to_repo(k, root): relative_to_repo(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_to_repo(v, root) for v in value]
    return value
