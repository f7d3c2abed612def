"""``lessmem-coverage``: which saved tensors a configured model compresses and which stay full.

    lessmem-coverage model=resnet18 compression=pool2 dataset=synthetic dataset.image_size=224 \
        coverage.batch=32 coverage.out=outputs/coverage/resnet18

Arguments are Hydra overrides of ``conf/train.yaml`` plus ``coverage.KEY=VALUE``. Writes the
terminal table, ``coverage.csv``, ``coverage.json`` (rows + totals) and ``coverage.png`` (bytes
per layer, stacked: compressed vs full; the title gives the share of stock PyTorch).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from lessmem.cli.errors import one_line, user_errors
from lessmem.cli.options import split_options
from lessmem.experiment import compose_config, coverage_for_config, save_report

_DEFAULTS = {"batch": None, "out": None, "full_only": False}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        hydra_args, opts = split_options(argv, "coverage", _DEFAULTS)
        cfg = compose_config(hydra_args)
        report = coverage_for_config(cfg, int(opts["batch"]) if opts["batch"] else None)
    except (*user_errors(), KeyError) as e:  # bad config / file: one line, no traceback
        print(f"lessmem-coverage: error: {one_line(e)}", file=sys.stderr)
        return 2
    print(report.table(full_only=bool(opts["full_only"])))
    name = f"{cfg.model.name} / {cfg.compression.get('name', 'custom')}"
    out = Path(str(opts["out"] or f"outputs/coverage/{cfg.model.name}_{cfg.compression.get('name', 'custom')}"))
    for kind, path in save_report(report, out, name).items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
