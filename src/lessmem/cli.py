"""Console entry points. Keep imports light: heavy modules load inside the functions."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from lessmem.paths import conf_dir

CONF_DIR = str(conf_dir())


# --------------------------------------------------------------------------- train


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def train_main(cfg: DictConfig) -> float:
    """``lessmem-train`` / ``python -m lessmem.train``: one run (or a sweep with ``-m``)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from lessmem.train import run

    if not cfg.get("out_dir"):
        OmegaConf.set_struct(cfg, False)
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    m = run(cfg)
    print(
        f"{m['model']} / {m['compression']}: top1 {m['final_top1']:.4f} (best {m['best_top1']:.4f} "
        f"@ epoch {m['best_epoch']}), saved {m['saved_bytes'] / 2**20:.2f} MiB vs stock "
        f"{m['stock_saved_bytes'] / 2**20:.2f} MiB (ratio {m['ratio']:.3f}), "
        f"{m['train_time_s']:.1f}s -> {cfg.out_dir}"
    )
    return float(m["final_top1"])  # for Hydra sweepers that optimize the return value


# --------------------------------------------------------------------------- memory
# (memory_main: owned by another engineer)


# --------------------------------------------------------------------------- sensitivity
# (sensitivity_main: owned by another engineer)


# --------------------------------------------------------------------------- search
# (search_main: owned by another engineer)
