"""Log a sweep's or search's trade-off table and plots to W&B as one run (offline by default).

    python analysis/wandb_log.py multirun/cifar10_resnet20_6ep
    python analysis/wandb_log.py outputs/search/train_resnet20 --mode online --project lessmem
    wandb sync <dir>/wandb/offline-run-*            # later, with network

Logs a wandb.Table (one row per configuration: map, kernels, saved bytes, peak, ratio, top-1,
top-5, train time), a memory-vs-accuracy scatter, the Pareto front (table + line) and the
matplotlib figure. Hydra multiruns can do this automatically at the end with
`+hydra.callbacks.tradeoff._target_=lessmem.reporting.WandbSweepCallback`.
"""

from __future__ import annotations

import argparse
import sys

from lessmem.reporting import log_dir_to_wandb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--project", default="lessmem")
    p.add_argument("--mode", default="offline", choices=["offline", "online", "disabled"])
    p.add_argument("--name")
    args = p.parse_args(argv)
    try:
        payload = log_dir_to_wandb(args.dir, project=args.project, mode=args.mode, name=args.name)
    except FileNotFoundError as e:
        print(f"wandb_log: {e}", file=sys.stderr)
        return 2
    print("logged:", ", ".join(sorted(payload)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
