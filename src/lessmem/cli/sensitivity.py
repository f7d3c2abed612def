"""``lessmem-sensitivity [hydra overrides]``: measure the menu of a configured model (every
compression choice's bytes and gradient error, ``lessmem.search.measure_config_menu``) and write
menu.json / menu.csv / menu.png and the knapsack's map of least ``sensitivity.criterion`` within
``sensitivity.budget`` (a fraction of stock's total saved bytes).

    lessmem-sensitivity model=resnet20 dataset=cifar10 sensitivity.batches=4 sensitivity.out=DIR
    lessmem-sensitivity model=resnet20 menu=kernels          # kernel-only: pooling, native storage

The config is ``conf/sensitivity.yaml``: the training config, the ``menu`` group (``full`` or
``kernels``) and ``sensitivity.*``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from lessmem.cli.errors import command_args, exit_on_user_error
from lessmem.experiment import compose_config
from lessmem.search import check_criterion, measure_config_menu, write_menu_files
from lessmem.sensitivity import JOINT_KIND, MAP_KINDS, MenuResult

# Uniform options the summary prints (conv spec, BatchNorm storage), those the menu measured.
UNIFORM = [("2", "native"), ("4", "native"), ("int8", "native"), ("int8", "int8"), ("2/int4", "native"),
           ("int4", "int4"), ("int4", "int2"), ("2/int4", "int4")]


def _print_menu(result: MenuResult) -> None:
    joint = sum(i.kind == JOINT_KIND for i in result.items)
    print(f"items: {len(result.items)} ({sum(i.kind in MAP_KINDS for i in result.items) + joint} layer inputs, "
          f"{joint} of them choosing with their BatchNorm: from_bn), "
          f"batches: {result.meta['batches']}; stock saved bytes {result.stock_bytes:,d}")
    print(f"  {'conv':>8} {'norm':>7}  {'ratio':>6}  {'grad_error':>10}  {'cosine':>7}")
    for conv, norm in UNIFORM:
        try:
            s = result.uniform(conv, norm)
        except ValueError:  # an option left out of this measurement
            continue
        print(f"  {conv:>8} {norm:>7}  {s['ratio']:6.3f}  {s['grad_error']:10.4g}  {s['cosine']:7.4f}")
    s = result.meta["chosen"]["score"]
    print(f"  {'chosen':>16}  {s['ratio']:6.3f}  {s['grad_error']:10.4g}  {s['cosine']:7.4f}")
    print(f"least reachable saved-bytes ratio: {result.least_ratio():.4f}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = command_args(argv, __doc__)
    if argv is None:
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with exit_on_user_error("lessmem-sensitivity"):
        cfg = compose_config(argv, "sensitivity")
        opts = cfg.sensitivity
        check_criterion(str(opts.criterion))
        result = measure_config_menu(cfg, cfg.menu, opts)
        out = Path(str(opts.out or f"outputs/sensitivity/{cfg.model.name}"))
        _, paths = write_menu_files(result, float(opts.budget), str(opts.criterion), out,
                                    Path(str(opts.map_out)) if opts.map_out else None)
    _print_menu(result)
    for key, p in paths.items():
        print(f"{key}: {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
