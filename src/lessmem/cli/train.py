"""``lessmem-train`` (``python -m lessmem.cli.train``): one run, or a sweep with ``-m``."""

from __future__ import annotations

import contextlib
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lessmem.cli.errors import exit_on_user_error, hydra_entry
from lessmem.experiment import conf_dir, run, task_of

CONF_DIR = str(conf_dir())


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _train(cfg: DictConfig) -> dict[str, Any]:
    from hydra.types import RunMode

    if not cfg.get("out_dir"):
        OmegaConf.set_struct(cfg, False)
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    # In a sweep a bad point fails its own job only: Hydra records the error for the sweeper.
    sweeping = HydraConfig.get().mode == RunMode.MULTIRUN
    with contextlib.nullcontext() if sweeping else exit_on_user_error("lessmem-train"):
        m = run(cfg)
    print(
        f"{m['model']} / {m['compression']}: {task_of(cfg).headline(m)}, saved {m['saved_bytes'] / 2**20:.2f} MiB vs stock "
        f"{m['stock_saved_bytes'] / 2**20:.2f} MiB (ratio {m['ratio']:.3f}), whole-step peak ratio "
        f"{m['step_peak_ratio']:.3f}, "
        f"{m['train_time_s']:.1f}s -> {cfg.out_dir}"
    )
    return m  # the metrics, for sweepers that optimize them (hydra.sweeper.objectives)


def train_main() -> None:
    """``lessmem-train`` / ``python -m lessmem.cli.train``: one run (or a sweep with ``-m``); Hydra
    arguments. Bad settings, missing data or an unreadable checkpoint: one error line, exit 2."""
    hydra_entry("lessmem-train", _train)


if __name__ == "__main__":
    train_main()
