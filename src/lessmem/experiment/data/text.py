"""Byte-level text that needs no download: the running Python's standard library, its source
(``source: code``) or the prose of its docstrings (``source: docstrings``), read in sorted file order
up to a fixed size and split into train / validation by file."""

from __future__ import annotations

import ast
import sysconfig
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lessmem.experiment.paths import resolve_path

# Third-party packages live under the stdlib directory too; they differ between installs.
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# Left out of the docstrings: container images and distributions often strip the test suites, and
# some of their files are invalid Python on purpose.
TEST_DIRS = {"test", "tests", "idle_test"}
SOURCES = ("code", "docstrings")
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


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


def docstrings(source: bytes) -> bytes:
    """The docstrings of a module's source (the module's, then its classes' and functions' in
    source order), indentation cleaned, each followed by a blank line; b"" if it does not parse."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # old string literals' invalid escapes
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return b""
    nodes = sorted((n for n in ast.walk(tree) if isinstance(n, DOCUMENTED)), key=lambda n: getattr(n, "lineno", 0))
    return "".join(f"{doc}\n\n" for n in nodes if (doc := ast.get_docstring(n))).encode()


def file_texts(root: Path, source: str) -> Iterator[bytes]:
    """Each file's text in sorted file order: its bytes (``code``), or its docstrings
    (``docstrings``: files without any, and test suites, left out)."""
    for path in text_files(root) if root.is_dir() else []:
        if source == "code":
            yield path.read_bytes()
        elif not TEST_DIRS.intersection(path.relative_to(root).parts) and (text := docstrings(path.read_bytes())):
            yield text


def stdlib_text(cfg: Mapping[str, Any]) -> tuple[TokenStream, TokenStream]:
    """(train, val): each file's text (``source``) in sorted file order until ``size_mb`` MB are
    read; every ``val_every``-th file goes to validation, the rest to training."""
    root = stdlib_root(cfg)
    seq_len, val_every = int(cfg["seq_len"]), int(cfg["val_every"])
    limit = int(float(cfg["size_mb"]) * 1_000_000)
    source = str(cfg.get("source") or "code")
    if seq_len < 1 or val_every < 2 or limit < 1 or source not in SOURCES:
        raise ValueError(f"stdlib_text needs seq_len >= 1, val_every >= 2, size_mb > 0 and source one of "
                         f"{', '.join(SOURCES)}; got seq_len={seq_len}, val_every={val_every}, "
                         f"size_mb={cfg['size_mb']}, source={source}")
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    total = 0
    for i, data in enumerate(file_texts(root, source)):
        if total >= limit:
            break
        splits[i % val_every == val_every - 1].append(data)
        total += len(data)
    train, val = (TokenStream(_byte_tensor(b"".join(parts)), seq_len, len(parts)) for parts in splits)
    what = ".py files" if source == "code" else "docstrings of the .py files"
    for name, split in (("train", train), ("val", val)):
        if len(split) == 0:
            raise ValueError(f"stdlib_text: no {name} block of {seq_len + 1} bytes from the {what} under {root} "
                             f"({split.files} files, {len(split.tokens)} bytes; size_mb={cfg['size_mb']}, "
                             f"val_every={val_every}); point dataset.root at a directory of .py files")
    return train, val
