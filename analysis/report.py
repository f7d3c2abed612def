"""Trade-off report of a sweep (Hydra multirun / any dir of runs) or a lessmem-search directory.

    python analysis/report.py multirun/cifar10_resnet20_6ep            # -> <dir>/report/
    python analysis/report.py outputs/search/train_resnet20 --out /tmp/r --title "resnet20 search"

Writes table.md, table.csv, memory_vs_accuracy.png (Pareto front in red) and accuracy_curves.png
(val/train top-1 per epoch per configuration). Reads metrics.json / metrics.jsonl, or the Optuna
journal (study.journal) / trials.csv of a search. No W&B needed.
"""

from __future__ import annotations

import argparse
import sys

from lessmem.reporting import report_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="sweep, run or search output directory")
    p.add_argument("--out", help="output directory (default: <dir>/report)")
    p.add_argument("--title")
    args = p.parse_args(argv)
    try:
        rep = report_dir(args.dir, args.out, args.title)
    except FileNotFoundError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    print(rep["markdown"])
    for name, path in rep["files"].items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
