"""``lessmem-coverage [hydra overrides]``: which saved tensors a configured model compresses and
which stay full.

    lessmem-coverage model=resnet18 compression=pool2 dataset=synthetic dataset.image_size=224 \
        coverage.batch=32 coverage.out=outputs/coverage/resnet18

The config is ``conf/coverage.yaml`` (the training config plus ``coverage.*``). Writes the
terminal table, ``coverage.csv``, ``coverage.json`` (rows + totals) and ``coverage.png`` (bytes
per layer, stacked: compressed vs full; the title gives the share of stock PyTorch).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lessmem.cli.errors import command_args, exit_on_user_error
from lessmem.experiment import compose_config, coverage_for_config, save_report


def main(argv: Sequence[str] | None = None) -> int:
    argv = command_args(argv, __doc__)
    if argv is None:
        return 0
    with exit_on_user_error("lessmem-coverage"):
        cfg = compose_config(argv, "coverage")
        opts = cfg.coverage
        report = coverage_for_config(cfg, int(opts.batch) if opts.batch else None)
    print(report.table(full_only=bool(opts.full_only)))
    name = f"{cfg.model.name} / {cfg.compression.get('name', 'custom')}"
    out = Path(str(opts.out or f"outputs/coverage/{cfg.model.name}_{cfg.compression.get('name', 'custom')}"))
    for kind, path in save_report(report, out, name).items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
