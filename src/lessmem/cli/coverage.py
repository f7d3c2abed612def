"""``lessmem-coverage [hydra overrides]``: which saved tensors a configured model compresses and
which stay full.

    lessmem-coverage model=resnet18 compression=pool2 dataset=synthetic dataset.image_size=224 \
        coverage.batch=32 hydra.run.dir=outputs/coverage/resnet18

The config is ``conf/coverage.yaml`` (the training config plus ``coverage.*``). Prints the table
and writes ``coverage.csv``, ``coverage.json`` (rows + totals) and ``coverage.png`` (bytes per
layer, stacked: compressed vs full; the title gives the share of stock PyTorch) to Hydra's run dir
(default ``outputs/coverage/<model>_<compression>``, also set by ``coverage.out=DIR``; in a
multirun each job's directory under ``hydra.sweep.dir``).
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lessmem.cli.errors import hydra_entry, job_errors
from lessmem.experiment import conf_dir, coverage_for_config, save_report

PROG = "lessmem-coverage"


@hydra.main(config_path=str(conf_dir()), config_name="coverage", version_base="1.3")
def _coverage(cfg: DictConfig) -> None:
    opts = cfg.coverage
    with job_errors(PROG):
        report = coverage_for_config(cfg, int(opts.batch) if opts.batch else None)
    print(report.table(full_only=bool(opts.full_only)))
    name = f"{cfg.model.name} / {cfg.compression.get('name', 'custom')}"
    for kind, path in save_report(report, Path(HydraConfig.get().runtime.output_dir), name).items():
        print(f"{kind}: {path}")


def main() -> None:
    """``lessmem-coverage``: Hydra arguments; a bad setting ends with one error line, exit 2."""
    hydra_entry(PROG, _coverage)


if __name__ == "__main__":
    main()
