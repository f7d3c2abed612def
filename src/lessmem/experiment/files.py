"""Atomic file writes: a reader (or a resumed run) sees the previous file or the new one, never
half of one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lessmem.experiment.faults import fault_point


def atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(temp)`` then rename the temp file onto ``path``; a crash before the rename leaves
    the previous file intact. The temp file sits next to ``path`` (a rename within one file
    system) and carries the pid, so processes filling the same cache never share one.
    ``LESSMEM_FAULT=replace_<file name>:<n>`` kills the process between write and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    fault_point(f"replace_{path.name}")
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_write_text(text: str, path: Path) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))
