"""Composing the Hydra configs outside ``@hydra.main`` (sensitivity, coverage, search), and
editing a composed config."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from lessmem.experiment.paths import conf_dir


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
    struct = OmegaConf.is_struct(cfg)
    OmegaConf.set_struct(cfg, False)
    try:
        yield
    finally:
        OmegaConf.set_struct(cfg, struct)
