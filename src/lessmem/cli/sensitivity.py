"""``lessmem-sensitivity [hydra overrides]``: measure the menu of a configured model (every
compression choice's bytes and gradient error, ``lessmem.search.measure_config_menu``) and write
menu.json / menu.csv / menu.png and the knapsack's map of least ``sensitivity.criterion`` within
``sensitivity.budget`` (a fraction of stock's total saved bytes).

    lessmem-sensitivity model=resnet20 dataset=cifar10 sensitivity.batches=4 hydra.run.dir=DIR
    lessmem-sensitivity model=resnet20 menu=kernels          # kernel-only: pooling, native storage
    lessmem-sensitivity -m model=resnet20,resnet18_cifar     # one menu per model (multirun)

The config is ``conf/sensitivity.yaml``: the training config, the ``menu`` group (``full`` or
``kernels``) and ``sensitivity.*``. Everything goes to Hydra's run dir (default
``outputs/sensitivity/<model>``, also set by ``sensitivity.out=DIR``; in a multirun each job's
directory under ``hydra.sweep.dir``)."""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lessmem.cli.errors import hydra_entry, job_errors
from lessmem.experiment import conf_dir, step_timer
from lessmem.search import check_criterion, measure_config_menu, write_menu_files
from lessmem.sensitivity import JOINT_KIND, MAP_KINDS, MenuResult

PROG = "lessmem-sensitivity"
# Uniform options the summary prints (conv spec, BatchNorm storage), those the menu measured.
UNIFORM = [("2", "native"), ("4", "native"), ("int8", "native"), ("int8", "int8"), ("2/int4", "native"),
           ("int4", "int4"), ("int4", "int2"), ("2/int4", "int4")]


def _print_menu(result: MenuResult, max_step_ratio: float) -> None:
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
    print(f"least reachable saved-bytes ratio: {result.least_ratio(max_step_ratio):.4f}"
          + (f" (regions recomputed within {max_step_ratio}x stock's step)" if result.regions and max_step_ratio > 1 else ""))


@hydra.main(config_path=str(conf_dir()), config_name="sensitivity", version_base="1.3")
def _sensitivity(cfg: DictConfig) -> None:
    with job_errors(PROG):
        opts = cfg.sensitivity
        check_criterion(str(opts.criterion))
        if int(opts.time_steps) < 0:
            raise ValueError(f"sensitivity.time_steps={opts.time_steps}: steps to time the map with, 0 for none")
        result = measure_config_menu(cfg, cfg.menu, opts)
        out = Path(HydraConfig.get().runtime.output_dir)
        timer = step_timer(cfg, int(opts.batch_size), str(opts.split), int(opts.time_steps)) if opts.time_steps else None
        _, paths = write_menu_files(result, float(opts.budget), str(opts.criterion), out,
                                    Path(str(opts.map_out)) if opts.map_out else None, float(opts.max_step_ratio), timer)
    _print_menu(result, float(opts.max_step_ratio))
    for key, p in paths.items():
        print(f"{key}: {p}")


def main() -> None:
    """``lessmem-sensitivity``: Hydra arguments; bad settings or an unreadable checkpoint end with
    one error line, exit 2."""
    hydra_entry(PROG, _sensitivity)


if __name__ == "__main__":
    main()
