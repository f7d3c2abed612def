"""Byte-level text that needs no download: the running Python's standard library source, read in
sorted file order up to a fixed size and split into train / validation by file."""

from __future__ import annotations

import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lessmem.experiment.paths import resolve_path

# Third-party packages live under the stdlib directory too; they differ between installs.
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class TokenStream:
    """One split as a 1-D uint8 tensor of byte tokens (vocabulary 256), read in blocks of
    ``seq_len`` inputs and their next-token targets."""

    tokens: Tensor
    seq_len: int
    files: int

    def __len__(self) -> int:
        """Non-overlapping blocks the split holds (a block needs seq_len + 1 bytes)."""
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def blocks_at(self, starts: Tensor) -> tuple[Tensor, Tensor]:
        """(inputs, targets) int64 of shape (len(starts), seq_len): targets are inputs shifted by one."""
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        window = self.tokens[idx].long()
        return window[:, :-1], window[:, 1:]


def _byte_tensor(data: bytes) -> Tensor:
    # frombuffer refuses an empty buffer; an empty split is reported by the caller
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def stdlib_root(cfg: Mapping[str, Any]) -> Path:
    root = cfg.get("root")
    return resolve_path(root) if root else Path(sysconfig.get_paths()["stdlib"])


def text_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` outside installed packages, sorted by relative path so
    the order is the same on every machine with this Python."""
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not SKIPPED_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_text(cfg: Mapping[str, Any]) -> tuple[TokenStream, TokenStream]:
    """(train, val): whole files in sorted order until ``size_mb`` MB are read; every
    ``val_every``-th file goes to validation, the rest to training."""
    root = stdlib_root(cfg)
    seq_len, val_every = int(cfg["seq_len"]), int(cfg["val_every"])
    limit = int(float(cfg["size_mb"]) * 1_000_000)
    if seq_len < 1 or val_every < 2 or limit < 1:
        raise ValueError(f"stdlib_text needs seq_len >= 1, val_every >= 2 and size_mb > 0; got seq_len={seq_len}, "
                         f"val_every={val_every}, size_mb={cfg['size_mb']}")
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    total = 0
    for i, path in enumerate(text_files(root) if root.is_dir() else []):
        if total >= limit:
            break
        data = path.read_bytes()
        splits[i % val_every == val_every - 1].append(data)
        total += len(data)
    train, val = (TokenStream(_byte_tensor(b"".join(parts)), seq_len, len(parts)) for parts in splits)
    for name, split in (("train", train), ("val", val)):
        if len(split) == 0:
            raise ValueError(f"stdlib_text: no {name} block of {seq_len + 1} bytes from the .py files under {root} "
                             f"({split.files} files, {len(split.tokens)} bytes; size_mb={cfg['size_mb']}, "
                             f"val_every={val_every}); point dataset.root at a directory of .py files")
    return train, val
