"""The proof of issue 19, maps that win at a memory budget: resnet20 on CIFAR-10, every
configuration on the same seeds, at three budgets of total saved bytes: that of uniform 2x2, of
uniform 4x4, and 0.15x stock.

Configurations (map files in ``<out>/maps/<config>.yaml``; the uniform ones are written here, the
chosen ones by the menu knapsack, ``analysis/menu_maps.py``, and copied in): at every budget the
uniform options that fit it, the criterion's map (``chosen_*``; ``kernels_*``: the kernel-only menu)
and the best map of an Optuna menu search at that budget (``search_*``: a ``lessmem-search`` job of
``sweeps/menu_resnet20.yaml`` run here first, its trials scored on held-out train images, not the
test set); stock once. A configuration whose map file does not exist yet waits for it (the driver
polls), so the chosen maps can be added while the uniform runs train.

    python analysis/proof.py --out docs/results/budget_proof --epochs 2 --train-subset 10000
    python analysis/proof.py --out docs/results/budget_proof --configs pool4 int8_bn8 --seeds 0 1 2
    python analysis/proof_summary.py docs/results/budget_proof

Default schedule: the issue-12 proof's (4 epochs on a balanced 20,000-image subset, batch 128, SGD
lr 0.1 Nesterov, cosine, full 10k test set); ``stock`` runs of that proof can be reused with
``--reuse docs/results/proof`` (same schedule and seeds).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml
from jobs import REPO, Job, schedule, train_job

from lessmem.sensitivity import MenuResult

MENU = REPO / "docs" / "results" / "criterion_check" / "menu" / "menu.json"

# config -> (budget it belongs to, conv spec, BatchNorm storage); None: map file comes from elsewhere
# (the menu knapsack: chosen_* on the whole menu, kernels_* on the kernel-only one). A config also
# competes at every larger budget, since its bytes fit there too.
CONFIGS: dict[str, tuple[str, str | None, str | None]] = {
    "stock": ("all", None, None),
    "pool2": ("2x2", "2", "native"),
    "chosen_2x2": ("2x2", None, None),
    "kernels_2x2": ("2x2", None, None),
    "search_2x2": ("2x2", None, None),
    "pool4": ("4x4", "4", "native"),
    "pool2_int4": ("4x4", "2/int4", "native"),
    "int8_bn8": ("4x4", "int8", "int8"),
    "chosen_4x4": ("4x4", None, None),
    "kernels_4x4": ("4x4", None, None),
    "search_4x4": ("4x4", None, None),
    "pool2_int4_bn4": ("0.15", "2/int4", "int4"),
    "int4_bn2": ("0.15", "int4", "int2"),
    "int2_bn4": ("0.15", "int2", "int4"),
    "chosen_0.15": ("0.15", None, None),
    "cosine_0.15": ("0.15", None, None),  # the knapsack on mean cosine instead of whole-gradient error
    "search_0.15": ("0.15", None, None),
}
# The tightest budget first, each chosen map beside the uniform option that fits with the least
# predicted whole-gradient error (int4_bn2 at 0.15, int8_bn8 at 4x4's bytes); the other options after.
ORDER = ["chosen_0.15", "cosine_0.15", "int4_bn2", "chosen_4x4", "int8_bn8", "stock", "pool4", "pool2", "pool2_int4_bn4",
         "kernels_4x4", "search_0.15", "search_4x4", "search_2x2", "chosen_2x2", "kernels_2x2", "pool2_int4", "int2_bn4"]


def search_budgets(menu: MenuResult) -> dict[str, float]:
    """Budget -> saved-bytes ratio the search must fit: uniform 2x2's and 4x4's as the menu
    predicts them (exactly what those runs measure), 0.15."""
    return {"2x2": menu.uniform("2")["ratio"], "4x4": menu.uniform("4")["ratio"], "0.15": 0.15}


def search_dir(out: Path, ratio: float) -> Path:
    return out / "search" / f"b{ratio:.4g}"


def search_job(out: Path, budget: str, ratio: float, menu: Path, n_trials: int) -> Job:
    """The Optuna menu search at one budget; its best map trains as ``search_<budget>``."""
    folder = search_dir(out, ratio)
    argv = [sys.executable, "-m", "lessmem.cli.search", "-cd", str(REPO / "sweeps"), "-cn", "menu_resnet20",
            f"budget={ratio:.4g}", f"study_name=menu_resnet20_b{ratio:.4g}", f"out_dir={folder}",
            f"menu_file={menu}", f"n_trials={n_trials}"]
    return Job(f"search_{budget}", argv, folder / "summary.json")


def map_file(out: Path, config: str) -> Path:
    return out / "maps" / f"{config}.yaml"


def write_uniform_maps(out: Path) -> None:
    (out / "maps").mkdir(parents=True, exist_ok=True)
    for config, (_, conv, norm) in CONFIGS.items():
        path = map_file(out, config)
        if conv is not None and not path.exists():
            body = {"name": config, "exact_companions": True, "norm_storage": norm, "map": {"*": conv}}
            path.write_text(yaml.safe_dump(body, sort_keys=False))


def reuse_runs(out: Path, source: Path, configs: list[str], seeds: list[int]) -> None:
    """Copy finished runs of the same schedule and seeds (metrics only) from another proof."""
    for config in configs:
        for seed in seeds:
            src, dest = source / "runs" / config / f"seed{seed}", out / "runs" / config / f"seed{seed}"
            if (src / "metrics.json").exists() and not dest.exists():
                shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.pt"))
                (dest / "REUSED").write_text(f"copied from {src}\n")


def jobs_for(out: Path, args: argparse.Namespace) -> list[Job]:
    common = ["model=resnet20", "dataset=cifar10", "logger=csv", "device=cpu", f"epochs={args.epochs}",
              "batch_size=128", "channels_last=true", "memory_batch=32",
              f"dataset.train_subset={args.train_subset}"]
    budgets = search_budgets(MenuResult.load(args.menu))
    searched = [c for c in ORDER if c in args.configs and c.startswith("search_")]
    jobs = [search_job(out, CONFIGS[c][0], budgets[CONFIGS[c][0]], args.menu, args.search_trials) for c in searched]
    for seed in args.seeds:  # seed-major: a partial proof still pairs every configuration
        for config in [c for c in ORDER if c in args.configs]:
            if config == "stock":
                jobs.append(train_job(out, "stock", seed, ["compression=none"], common))
                continue
            searched_here = config.startswith("search_")
            path = (search_dir(out, budgets[CONFIGS[config][0]]) / "best_map.yaml" if searched_here
                    else map_file(out, config))
            jobs.append(train_job(out, config, seed, ["compression=pool2", f"compression.map_file={path}",
                                                      f"compression.name={config}"], common, needs=[path],
                                  deps=[config] if searched_here else None))
    return jobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "budget_proof")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--train-subset", type=int, default=20000)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--configs", nargs="+", default=ORDER, choices=ORDER)
    p.add_argument("--reuse", type=Path, default=None,
                   help="a proof directory with stock runs of the same schedule and seeds")
    p.add_argument("--menu", type=Path, default=MENU, help="menu.json the searches weight (lessmem-sensitivity)")
    p.add_argument("--search-trials", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    out = args.out.resolve()
    write_uniform_maps(out)
    if args.reuse:
        reuse_runs(out, args.reuse.resolve(), ["stock"], args.seeds)
    schedule(jobs_for(out, args), args.workers, args.threads, out)


if __name__ == "__main__":
    main()
