"""Does a sensitivity-chosen kernel map beat uniform 2x2 in accuracy at the same saved bytes?

Runs (resumable: finished runs are skipped, interrupted ones resume from their checkpoint):
  stock, uniform 2x2, the greedy sensitivity map at the conv-input bytes of 2x2 (measured on the
  stock seed-0 model after one epoch), the adaptive schedule at that budget, and the best map of
  an accuracy-objective Optuna search (per-stage kernels, median pruning), for each seed;
  plus sensitivity tables of the stock seed-0 model at init and after every epoch.

    python analysis/proof_2x2.py --out docs/results/proof --epochs 4 --train-subset 20000 --workers 2
    python analysis/proof_2x2.py --out docs/results/proof --summarize   # table + plots only

Each run is its own process (``OMP_NUM_THREADS=--threads``); ``--workers`` run at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jobs import HERE, REPO, Job, schedule, train_job


def sensitivity_job(out: Path, epoch: int, common: list[str], deps: list[str]) -> Job:
    ckpt = out / "runs" / "stock" / "seed0" / f"checkpoint_epoch{epoch}.pt"
    dest = out / "sensitivity" / f"epoch{epoch}"
    argv = [sys.executable, "-m", "lessmem.cli.sensitivity", *common, "seed=0",
            "menu=kernels", "sensitivity.batches=4", "sensitivity.batch_size=128", "sensitivity.budget=0.6",
            f"sensitivity.out={dest}",
            f"sensitivity.map_out={dest / 'greedy_map.yaml'}"]
    if epoch > 0:
        argv.append(f"sensitivity.checkpoint={ckpt}")
    return Job(f"sensitivity/epoch{epoch}", argv, dest / "greedy_map.yaml", deps)


def search_job(out: Path, common: list[str], n_trials: int, deps: list[str]) -> Job:
    ckpt = out / "runs" / "stock" / "seed0" / "checkpoint_epoch1.pt"
    base = [*common, "dataset.train_subset=10000", "dataset.val_subset=2000", "epochs=2", "seed=0"]
    argv = [sys.executable, "-m", "lessmem.cli.search", "-cd", str(REPO / "sweeps"), "-cn", "proof_resnet20",
            f"out_dir={out / 'search'}", f"n_trials={n_trials}",
            f"sensitivity.checkpoint={ckpt}", f"base_overrides={json.dumps(base)}"]
    return Job("search", argv, out / "search" / "summary.json", deps)


def best_map_file(out: Path) -> Path:
    summary = json.loads((out / "search" / "summary.json").read_text())
    trial = summary["best"]["trial"]
    return out / "search" / "trials" / f"{trial:04d}" / "compression.yaml"


def jobs_for(args: argparse.Namespace) -> list[Job]:
    out = args.out
    common = ["model=resnet20", "dataset=cifar10", "logger=csv", "device=cpu", f"epochs={args.epochs}",
              "batch_size=128", "channels_last=true", "memory_batch=32"]
    if args.train_subset:
        common.append(f"dataset.train_subset={args.train_subset}")
    greedy = out / "sensitivity" / "epoch1" / "greedy_map.yaml"
    jobs = [train_job(out, "stock", 0, ["compression=none"], common, keep=True),
            train_job(out, "pool2", 0, ["compression=pool2"], common)]
    sens_common = ["model=resnet20", "dataset=cifar10", "device=cpu"]
    jobs += [sensitivity_job(out, e, sens_common, ["stock/seed0"]) for e in range(args.epochs + 1)]
    for seed in args.seeds:
        if seed != 0:
            jobs += [train_job(out, "stock", seed, ["compression=none"], common),
                     train_job(out, "pool2", seed, ["compression=pool2"], common)]
        jobs.append(train_job(out, "greedy", seed, ["compression=pool2", f"compression.map_file={greedy}",
                                                    "compression.name=greedy"], common,
                              deps=["sensitivity/epoch1"]))
    jobs.append(search_job(out, common[:4] + ["channels_last=true", "batch_size=128"], args.search_trials,
                           ["stock/seed0"]))
    for seed in args.seeds:
        jobs.append(train_job(out, "adaptive", seed, ["compression=pool2", "compression.name=adaptive",
                                                      "adaptive.every=1", "adaptive.budget=0.25",
                                                      "adaptive.probe_batch=128"], common))
    for seed in args.seeds:
        # map file resolved when the job starts (after the search)
        jobs.append(train_job(out, "optuna", seed, ["compression=pool2", "compression.name=optuna",
                                                    "compression.map_file=@BEST@"], common,
                              deps=["search"]))
    return jobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "proof")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--search-trials", type=int, default=10)
    p.add_argument("--train-subset", type=int, default=None,
                   help="train on a balanced subset of N images (same for every run); test set stays whole")
    p.add_argument("--configs", nargs="+", default=["stock", "pool2", "greedy", "adaptive", "optuna"],
                   help="train only these (e.g. more seeds of stock pool2 greedy); sensitivity and "
                        "search jobs run when a chosen config needs them")
    p.add_argument("--summarize", action="store_true", help="only write the summary from finished runs")
    args = p.parse_args()
    args.out = args.out.resolve()
    if not args.summarize:
        jobs = [j for j in jobs_for(args)
                if j.name.split("/")[0] in args.configs or j.name.startswith(("sensitivity", "search"))]
        if "optuna" not in args.configs:
            jobs = [j for j in jobs if j.name != "search"]
        schedule(jobs, args.workers, args.threads, args.out,
                 resolve=lambda argv: [a.replace("@BEST@", str(best_map_file(args.out))) for a in argv])
    sys.path.insert(0, str(HERE))
    from proof_2x2_summary import summarize

    summarize(args.out)


if __name__ == "__main__":
    main()
