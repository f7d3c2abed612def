"""One proof driver for any model: maps that win at a memory budget, every configuration on the
same seeds (issue 31). For a model preset (``--model resnet20`` on the issue-12 schedule,
``--model tiny_llama`` on ``experiment=lm_quick``):

1. the menu, measured once on the weights being trained (``lessmem-sensitivity`` after
   ``warmup_steps`` stock steps, several batches of the memory batch size) into ``<out>/menu``
   (or ``--menu``);
2. at every budget (a fraction of stock's saved bytes): the knapsack's map (``chosen_<budget>``),
   the best map of an Optuna menu search at that budget (``search_<budget>``: a ``lessmem-search``
   job of ``sweeps/<preset sweep>.yaml`` run here first; ``--search-trials 0``: none), the uniform
   options that fit it (the ``--uniform-per-budget`` spending most of it, their bytes exactly as
   the menu predicts), the ``--map-files`` (hand maps, e.g. a compression preset), and stock;
3. every configuration trained on ``--seeds`` (8 paired seeds by default), two jobs at a time with
   one thread each; a finished run is skipped, an interrupted one resumes;
4. ``<out>/proof.json`` (the layout ``analysis/proof_summary.py`` reads) and the summary. A part of
   the proof (``--configs``) keeps the layout the proof has there (restored from a published
   runs.json, say) and adds only the configurations it lacked.

    python analysis/proof.py --model resnet20 --out docs/results/proof_resnet20 --budgets 0.125 0.08 0.05
    python analysis/proof.py --model tiny_llama --out docs/results/proof_tiny_llama --budgets 0.5 0.25 0.12
    python analysis/proof_summary.py docs/results/proof_tiny_llama

``--criterion-check N``: instead, N maps spread over the budgets' range (knapsack maps of every
criterion at each budget, the uniform options, random per-unit maps), one seed each, ranked by
``analysis/criterion_summary.py`` (Spearman of each criterion with the final metric).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from jobs import REPO, Job, schedule, train_job
from repo_paths import relative_to_repo

from lessmem.core import CompressionPlan
from lessmem.sensitivity import (
    CRITERIA,
    DEFAULT_CRITERION,
    MenuResult,
    ScoredPlan,
)
from lessmem.sensitivity.items import shared_options


@dataclass
class Preset:
    """A model's proof: its training schedule, how its menu is measured, its metric, its search
    config and the uniform options (conv spec, BatchNorm, activation, saved-region storage)."""

    train: list[str]
    sensitivity: list[str]
    metric: str
    label: str
    scale: float
    lower_is_better: bool
    sweep: str
    budgets: list[float]
    uniform: dict[str, tuple[str, str, str, str]] = field(default_factory=dict)


PRESETS = {
    # The issue-12 schedule: 4 epochs on a balanced 20k CIFAR-10 subset; the menu after one epoch's steps.
    "resnet20": Preset(
        train=["model=resnet20", "dataset=cifar10", "logger=csv", "device=cpu", "epochs=4", "batch_size=128",
               "channels_last=true", "memory_batch=32", "dataset.train_subset=20000"],
        sensitivity=["sensitivity.batches=8", "sensitivity.batch_size=${memory_batch}", "sensitivity.warmup_steps=156"],
        metric="final_top1", label="top-1", scale=100.0, lower_is_better=False, sweep="menu_resnet20",
        budgets=[0.125, 0.08, 0.05],
        uniform={"int8_bn8": ("int8", "int8", "native", "native"), "int4_bn4": ("int4", "int4", "native", "native"),
                 "pool2_int4_bn4": ("2/int4", "int4", "native", "native"),
                 "int4_bn2": ("int4", "int2", "native", "native"), "int2_bn4": ("int2", "int4", "native", "native"),
                 "int2_bn2": ("int2", "int2", "native", "native"), "int1_bn2": ("int1", "int2", "native", "native"),
                 "int2_bn1": ("int2", "int1", "native", "native"), "int1_bn1": ("int1", "int1", "native", "native"),
                 "pool2_int2_bn2": ("2/int2", "int2", "native", "native"),
                 "pool2_int1_bn1": ("2/int1", "int1", "native", "native")}),
    # Issue 42, at convergence: all 50k images, experiment=cifar10_converged (its recipe tuned for stock);
    # the menu after one epoch of stock steps (391), as a user warms up before lessmem-sensitivity.
    "resnet20_converged": Preset(
        train=["experiment=cifar10_converged", "logger=csv", "memory_batch=32"],
        sensitivity=["sensitivity.batches=8", "sensitivity.batch_size=${memory_batch}", "sensitivity.warmup_steps=391"],
        metric="final_top1", label="top-1", scale=100.0, lower_is_better=False, sweep="menu_resnet20",
        budgets=[0.08]),
    # lm_quick: 300 steps of tiny_llama on the stdlib's source; the menu after 100 stock steps.
    "tiny_llama": Preset(
        train=["experiment=lm_quick", "logger=csv"],
        sensitivity=["sensitivity.batches=4", "sensitivity.batch_size=${memory_batch}", "sensitivity.warmup_steps=100"],
        metric="final_val_ppl", label="val_ppl", scale=1.0, lower_is_better=True, sweep="menu_tiny_llama",
        budgets=[0.5, 0.25, 0.12],
        uniform={f"{s}_all": (s, "native", s, s) for s in ("bf16", "int8", "int4", "int2", "int1")}
        | {f"pool2_{s}_all": (f"2/{s}", "native", s, s) for s in ("int4", "int2")}),
    # Issue 42, at convergence: experiment=lm_converged (3,000 steps, ten times lm_quick's; its learning rate
    # tuned for stock); the menu after 300 stock steps (lm_quick's warm-up scaled with the schedule).
    "lm_converged": Preset(
        train=["experiment=lm_converged", "logger=csv"],
        sensitivity=["sensitivity.batches=4", "sensitivity.batch_size=${memory_batch}", "sensitivity.warmup_steps=300"],
        metric="final_val_ppl", label="val_ppl", scale=1.0, lower_is_better=True, sweep="menu_tiny_llama",
        budgets=[0.25, 0.12],
        uniform={"int8_all": ("int8", "native", "int8", "int8")}),
    # Issue 45: lora_quick (LoRA on lm_quick's checkpoint, the stdlib's docstrings); the menu after 50 LoRA
    # steps (PEFT starts B at zero, which leaves every A gradient zero at step 0).
    "tiny_llama_lora": Preset(
        train=["experiment=lora_quick", "logger=csv"],
        sensitivity=["sensitivity.batches=4", "sensitivity.batch_size=${memory_batch}", "sensitivity.warmup_steps=50"],
        metric="final_val_ppl", label="val_ppl", scale=1.0, lower_is_better=True, sweep="menu_tiny_llama",
        budgets=[0.15, 0.10],
        uniform={f"{s}_all": (s, "native", s, s) for s in ("int8", "int4", "int2")}),
}


def measure_menu_job(out: Path, preset: Preset, extra: list[str], threads: int) -> Path:
    """``<out>/menu/menu.json``: measured here (synchronously) unless it exists."""
    menu = out / "menu" / "menu.json"
    if not menu.is_file():
        argv = [sys.executable, "-m", "lessmem.cli.sensitivity", *preset.train, *extra, *preset.sensitivity,
                f"sensitivity.out={out / 'menu'}", "sensitivity.budget=1.0"]
        env = {"OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1", "WANDB_MODE": "disabled"}
        print("measuring the menu:", " ".join(argv[1:]), flush=True)
        subprocess.run(argv, check=True, cwd=REPO, env={**os.environ, **env})
    return menu


def budget_name(budget: float) -> str:
    return f"{budget:g}"


def write_map(out: Path, name: str, choice: ScoredPlan, note: str) -> Path:
    path = out / "maps" / f"{name}.yaml"
    if not path.exists():
        choice.plan.replace(name=name).write(path, comment=f"{note}; predicted saved bytes {choice.score['ratio']:.4f}x stock")
    return path


def copy_map(out: Path, path: Path) -> str:
    """``path`` into ``out/maps`` as ``<stem>.yaml`` (a different file there under that name is an
    error, not overwritten); returns the config name."""
    if not path.is_file():
        raise SystemExit(f"--map-files: no file {path}")
    CompressionPlan.read(path)  # a clear error now, not in every run
    text, target = path.read_text(), out / "maps" / f"{path.stem}.yaml"
    if target.exists() and target.read_text() != text:
        raise SystemExit(f"--map-files: {target} exists and differs from {path}")
    target.write_text(text)
    return path.stem


def uniform_choices(menu: MenuResult, preset: Preset) -> dict[str, ScoredPlan]:
    """The preset's uniform options the menu measured (an option it lacks is left out)."""
    found = {}
    for name, options in preset.uniform.items():
        try:
            found[name] = menu.uniform_choice(*options)
        except ValueError:
            continue
    return found


def plan(menu: MenuResult, preset: Preset, budgets: list[float], per_budget: int,
         criterion: str, compared: list[str]) -> tuple[dict[str, ScoredPlan], dict[str, dict]]:
    """(config -> map, config -> {"home", "uniform"}): per budget the knapsack's map
    (``chosen_<budget>``), the knapsack's maps of the ``compared`` criteria (``<criterion>_<budget>``)
    and the ``per_budget`` fitting uniform options that spend most of it, each at its home budget
    (the tightest it fits, or where it was picked)."""
    uniform = uniform_choices(menu, preset)
    maps: dict[str, ScoredPlan] = {}
    configs: dict[str, dict] = {"stock": {"home": "all", "uniform": False}}
    for budget in sorted(budgets, reverse=True):
        name = budget_name(budget)
        maps[f"chosen_{name}"] = menu.make_map(budget, criterion)
        configs[f"chosen_{name}"] = {"home": name, "uniform": False}
        for other in compared:
            maps[f"{other}_{name}"] = menu.make_map(budget, other)
            configs[f"{other}_{name}"] = {"home": name, "uniform": False}
        fitting = sorted((c for c in uniform.items() if c[1].score["ratio"] <= budget),
                         key=lambda c: -c[1].score["ratio"])
        for config, choice in fitting[:per_budget]:
            maps[config] = choice
            configs[config] = {"home": name, "uniform": True}
    return maps, configs


def search_job(out: Path, preset: Preset, budget: float, menu: Path, n_trials: int, criterion: str,
               extra: list[str]) -> Job:
    """The Optuna menu search at one budget on the knapsack's criterion (its trial 0 is
    ``chosen_<budget>``); its best map trains as ``search_<budget>``."""
    folder = out / "search" / f"b{budget_name(budget)}"
    argv = [sys.executable, "-m", "lessmem.cli.search", "-cd", str(REPO / "sweeps"), "-cn", preset.sweep,
            f"budget={budget:g}", f"study_name={preset.sweep}_b{budget_name(budget)}", f"out_dir={folder}",
            f"menu_file={menu}", f"n_trials={n_trials}", f"criterion={criterion}", *extra]
    return Job(f"search_{budget_name(budget)}", argv, folder / "summary.json")


def jobs_for(out: Path, preset: Preset, args: argparse.Namespace, configs: dict[str, dict], menu: Path) -> list[Job]:
    jobs = []
    if args.search_trials > 0:
        for budget in args.budgets:
            config = f"search_{budget_name(budget)}"
            if _wanted(config, args.configs):
                configs[config] = {"home": budget_name(budget), "uniform": False}
                jobs.append(search_job(out, preset, budget, menu, args.search_trials, args.criterion, args.search_set))
    common = [*preset.train, *args.set]
    for seed in args.seeds:  # seed-major: a partial proof still pairs every configuration
        for config in [c for c in configs if _wanted(c, args.configs)]:
            if config == "stock":
                jobs.append(train_job(out, "stock", seed, ["compression=none"], common))
                continue
            if "overrides" in configs[config]:  # a configuration the run chooses itself (memory_budget=)
                jobs.append(train_job(out, config, seed, ["compression=none", *configs[config]["overrides"]], common))
                continue
            searched = config.startswith("search_")
            path = out / "search" / f"b{config.removeprefix('search_')}" / "best_map.yaml" if searched \
                else out / "maps" / f"{config}.yaml"
            jobs.append(train_job(out, config, seed, [f"compression.map_file={path}", f"compression.name={config}"],
                                  common, needs=[path], deps=[config] if searched else None))
    return jobs


def _wanted(config: str, patterns: list[str] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(config, p) for p in patterns)


def criterion_maps(menu: MenuResult, preset: Preset, budgets: list[float], n: int, seed: int) -> dict[str, ScoredPlan]:
    """``n`` maps spread from the tightest budget to 1.0: the knapsack's map of every criterion
    at each budget, the uniform options (the first ``n`` of these), then random per-unit maps
    (options drawn around a per-map aggressiveness) in empty ratio bins; no map twice."""
    maps: dict[str, ScoredPlan] = {}
    candidates = [(f"{c}_{budget_name(b)}", menu.make_map(b, c)) for b in budgets for c in menu.criteria]
    for name, choice in [*candidates, *uniform_choices(menu, preset).items()]:
        # Criteria can agree on a map (all of them at a loose budget); training it twice would count one result twice.
        if is_new(choice, maps):
            maps[name] = choice
    maps = dict(list(maps.items())[:n])
    units = list(menu.unit_items().values())
    by_name = {i.name: i for i in menu.items}
    rng = random.Random(seed)
    lo = max(min(budgets) * 0.9, menu.least_ratio())
    bins = max(n - len(maps), 0)
    edges = [lo + (1.0 - lo) * i / max(bins, 1) for i in range(bins + 1)]
    filled: set[int] = set()
    for _ in range(200 * max(bins, 1)):
        if len(filled) == bins:
            break
        level, chosen = rng.random(), {}
        for members in units:
            first = by_name[members[0]]
            options = sorted(shared_options([by_name[m] for m in members]), key=lambda o: -first.nbytes[first.index(o)])
            i = round(level * (len(options) - 1) + rng.gauss(0, 1.5))
            chosen.update(dict.fromkeys(members, options[min(max(i, 0), len(options) - 1)]))
        choice = menu.choice_of(chosen)
        b = next((i for i in range(bins) if edges[i] <= choice.score["ratio"] < edges[i + 1]), None)
        if b is not None and b not in filled and is_new(choice, maps):
            filled.add(b)
            maps[f"random{b:02d}"] = choice
    return maps


def is_new(choice: ScoredPlan, maps: dict[str, ScoredPlan]) -> bool:
    return not any(choice.plan.digest == kept.plan.digest for kept in maps.values())


def layout(preset: Preset, model: str, configs: dict[str, dict], budgets: list[float], menu: Path,
           argv: list[str], summary: str = "proof_summary") -> dict:
    """What ``proof_summary.py`` (``criterion_summary.py``) reads; ``argv``: the driver's own arguments,
    printed as its command."""
    return {"title": f"Maps at a memory budget ({model})", "model": model, "metric": preset.metric,
            "key": preset.label, "scale": preset.scale, "label": preset.label, "lower_is_better": preset.lower_is_better,
            "budgets": {budget_name(b): {"label": f"{b:g}x stock", "limit": b} for b in sorted(budgets, reverse=True)},
            "configs": configs, "menu": str(menu),
            "command": f"`python analysis/proof.py {shlex.join(argv)}` then `python analysis/{summary}.py DIR`",
            "search_note": (f"Per-unit weights on the menu knapsack (every trial's map fits its budget); trials as in "
                            f"`sweeps/{preset.sweep}.yaml`. Trial 0 is the knapsack's own map at that budget.")}


def part_of(before: dict, layout_now: dict) -> dict:
    """The layout a partial run (``--configs``) leaves: the proof's layout as written before (its
    command, title and seeds stay, a hand-written note too), with the configurations it lacked."""
    seeds = sorted(set(before.get("seeds", [])) | set(layout_now.get("seeds", [])))
    return before | {"configs": before["configs"] | {c: v for c, v in layout_now["configs"].items()
                                                       if c not in before["configs"]}} | ({"seeds": seeds} if seeds else {})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budgets", type=float, nargs="+", help="fractions of stock's saved bytes (default: the preset's)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    p.add_argument("--configs", nargs="+", default=None, help="only these configurations (fnmatch patterns; name stock to include it): the summary "
                        "waits for a run of every configuration")
    p.add_argument("--criterion", default=DEFAULT_CRITERION, choices=CRITERIA, help="the knapsack's criterion")
    p.add_argument("--compare-criteria", nargs="+", default=[], choices=CRITERIA, metavar="CRITERION",
                   help="also train the knapsack's maps of these criteria (<criterion>_<budget>)")
    p.add_argument("--uniform-per-budget", type=int, default=2)
    p.add_argument("--map-files", type=Path, nargs="+", default=[], metavar="FILE",
                   help="also train these map files (a compression preset or lessmem-sensitivity's format; "
                        "config: the file's stem, at the tightest budget)")
    p.add_argument("--override-configs", nargs="+", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="also train configurations given by overrides instead of a map, e.g. "
                        "'budget_0.45:memory_budget=86MiB' (the byte-budget path; at the tightest budget)")
    p.add_argument("--menu", type=Path, default=None, help="a menu.json to use instead of measuring one")
    p.add_argument("--search-trials", type=int, default=10, help="0: no menu search")
    p.add_argument("--set", nargs="*", default=[], help="more training overrides (KEY=VALUE), for every run")
    p.add_argument("--search-set", nargs="*", default=[], help="more lessmem-search overrides")
    p.add_argument("--criterion-check", type=int, default=0, metavar="N",
                   help="train N maps spread over the budgets on one seed, ranked by each criterion")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    preset = PRESETS[args.model]
    args.budgets = args.budgets or preset.budgets
    out = args.out.resolve()
    (out / "maps").mkdir(parents=True, exist_ok=True)
    menu_path = args.menu.resolve() if args.menu else measure_menu_job(out, preset, args.set, args.threads)
    menu = MenuResult.load(menu_path)
    print(f"menu: {menu_path} ({len(menu.items)} items); least reachable saved-bytes ratio {menu.least_ratio():.4f}",
          flush=True)
    if args.criterion_check:
        maps = criterion_maps(menu, preset, args.budgets, args.criterion_check, seed=0)
        configs = {"stock": {"home": "all", "uniform": False}} | {n: {"home": "all", "uniform": False} for n in maps}
        args.seeds, args.search_trials = args.seeds[:1], 0
    else:
        maps, configs = plan(menu, preset, args.budgets, args.uniform_per_budget, args.criterion,
                             args.compare_criteria)
    for name, choice in maps.items():
        write_map(out, name, choice, f"{args.model} proof map {name}")
    for path in args.map_files:
        configs[copy_map(out, path)] = {"home": budget_name(min(args.budgets)), "uniform": False}
    for spec in args.override_configs:
        name, _, overrides = spec.partition(":")
        if not name or "=" not in overrides:
            p.error(f"--override-configs {spec!r}: write NAME:KEY=VALUE[,KEY=VALUE]")
        configs[name] = {"home": budget_name(min(args.budgets)), "uniform": False, "overrides": overrides.split(",")}
    jobs = jobs_for(out, preset, args, configs, menu_path)
    layout_now = relative_to_repo(
        layout(preset, args.model, configs, args.budgets, menu_path, argv,
               "criterion_summary" if args.criterion_check else "proof_summary")
        | {"criterion": args.criterion, "seeds": args.seeds, "criterion_check": bool(args.criterion_check)})
    layout_file = out / "proof.json"
    if args.configs is not None and layout_file.is_file():  # a part of the proof: its layout stays the whole one's
        layout_now = part_of(json.loads(layout_file.read_text()), layout_now)
    layout_file.write_text(json.dumps(layout_now, indent=1))
    schedule(jobs, args.workers, args.threads, out)
    if args.configs is not None:
        print("--configs: a part of the proof ran; summarize with the driver without --configs", flush=True)
        return 0
    if args.criterion_check:
        from criterion_summary import summarize
    else:
        from proof_summary import summarize
    summarize(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
