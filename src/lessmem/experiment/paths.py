"""Where the Hydra configs, data and caches live, and composing the configs outside the
commands' ``@hydra.main`` (from Python, and a search's training runs). No heavy imports: Hydra
loads on first compose.

The configs ship inside the package (``lessmem/conf``, package data), so a plain
``pip install .`` or a wheel finds them; in a checkout ``<repo>/conf`` is a symlink to them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/lessmem
PACKAGE_CONF = PACKAGE_DIR / "conf"


def _repo_root() -> Path | None:
    """The source checkout this package runs from (editable install), or None when installed."""
    root = PACKAGE_DIR.parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "lessmem").is_dir() else None


REPO_ROOT = _repo_root()
DATA_ENV = "LESSMEM_DATA"
DEFAULT_DATA_DIR = "../shared/data"


def conf_dir() -> Path:
    """Hydra config directory: ``$LESSMEM_CONF`` or the package's own ``lessmem/conf``."""
    return Path(os.environ.get("LESSMEM_CONF") or PACKAGE_CONF).resolve()


def cache_dir() -> Path:
    """Decoded-dataset cache: ``$LESSMEM_CACHE`` or ``~/.cache/lessmem``."""
    return Path(os.environ.get("LESSMEM_CACHE") or Path.home() / ".cache" / "lessmem")


def default_data_root(name: str) -> Path:
    """Where dataset ``name`` is looked for unless ``dataset.root`` says otherwise:
    ``$LESSMEM_DATA/<name>``, else ``../shared/data/<name>``; relative, for ``resolve_path``.
    The dataset configs read it as ``${lessmem.data_root:<name>}``."""
    return Path(os.environ.get(DATA_ENV) or DEFAULT_DATA_DIR) / name


def register_config_resolvers() -> None:
    """Make ``${lessmem.data_root:NAME}`` resolvable in composed configs."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("lessmem.data_root"):
        OmegaConf.register_new_resolver("lessmem.data_root", lambda name: str(default_data_root(name)))


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """Absolute paths as given; relative ones against the cwd if they exist there, else against
    the repo root of a source checkout (so configs like ``../shared/data/cifar10`` work from
    anywhere in it), else against the cwd."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_absolute():
        return p
    if p.exists() or REPO_ROOT is None:
        return p.resolve()
    return (REPO_ROOT / p).resolve()


def compose_config(overrides: Sequence[str], config_name: str = "train") -> DictConfig:
    """Hydra compose of ``<conf_dir>/<config_name>.yaml`` with command-line style overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name, overrides=list(overrides))


@contextlib.contextmanager
def open_struct(cfg: DictConfig) -> Iterator[None]:
    """Allow new keys for a moment (configs from compose() are in struct mode)."""
    from omegaconf import OmegaConf

    struct = OmegaConf.is_struct(cfg)
    OmegaConf.set_struct(cfg, False)
    try:
        yield
    finally:
        OmegaConf.set_struct(cfg, struct)
