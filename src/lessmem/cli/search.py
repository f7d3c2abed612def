"""``lessmem-search``: an Optuna search over compression maps from a sweep file (resumable)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import optuna

from lessmem.search import DEFAULTS, load_sweep, run_search


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lessmem-search",
        description="Optuna search over compression maps (resumable). Extra KEY=VALUE arguments "
                    f"override the sweep file; keys: {', '.join(sorted(DEFAULTS))}.")
    parser.add_argument("--config", help="sweep YAML, e.g. sweeps/fidelity_resnet18_cifar.yaml")
    parser.add_argument("--worker", action="store_true",
                        help="one of several processes sharing the study: start the same command "
                             "N times (any hosts); together they finish exactly n_trials")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE, e.g. n_trials=80 out_dir=/tmp/s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        sweep = load_sweep(args.config, args.overrides)
        summary = run_search(sweep, worker=args.worker)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"lessmem-search: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in summary.items() if k != "pareto"}, indent=1))
    print(f"report: {summary.get('report') or Path(sweep.out_dir) / 'pareto.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
