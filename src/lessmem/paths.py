"""Where the repo, its Hydra configs, data and caches live (no heavy imports)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def conf_dir() -> Path:
    """Hydra config directory: ``$LESSMEM_CONF`` or ``<repo>/conf``."""
    return Path(os.environ.get("LESSMEM_CONF") or REPO_ROOT / "conf").resolve()


def cache_dir() -> Path:
    """Decoded-dataset cache: ``$LESSMEM_CACHE`` or ``~/.cache/lessmem``."""
    return Path(os.environ.get("LESSMEM_CACHE") or Path.home() / ".cache" / "lessmem")


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """Absolute paths as given; relative ones against the cwd if they exist there, else against
    the repo root, so configs like ``../shared/data/cifar10`` work from anywhere."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_absolute():
        return p
    return p.resolve() if p.exists() else (REPO_ROOT / p).resolve()
