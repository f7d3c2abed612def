"""Summary of analysis/proof.py runs: per budget, every configuration's final metric over the
same seeds (mean, std, per seed), paired differences (same seed) against stock and against the best
uniform option that fits, with a two-sided paired t-test and a bootstrap 95% interval of the mean
paired difference, and the memory-vs-metric frontier plot. The layout (model, metric, budgets,
configurations) is ``<out>/proof.json``, written by the driver (carried in runs.json once compacted);
folders from before it (the issue-19 resnet20 proofs) use ``LEGACY``. Writes ``<out>/summary.md``,
``summary.json`` and ``frontier.png``.

    python analysis/proof_summary.py docs/results/budget_proof
"""

from __future__ import annotations

import json
import math
import random
import re
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from compact_runs import by_seed, names, read
from compact_runs import load as load_table
from repo_paths import REPO, relative_to_repo

from lessmem.sensitivity import MenuResult

# The issue-19 resnet20 proof (docs/results/budget_proof*): config -> (home budget, conv spec of a
# uniform option or None); budgets "2x2" / "4x4" are uniform pooling's bytes.
_LEGACY_CONFIGS = {
    "stock": ("all", None), "pool2": ("2x2", "2"), "chosen_2x2": ("2x2", None), "kernels_2x2": ("2x2", None),
    "search_2x2": ("2x2", None), "pool4": ("4x4", "4"), "pool2_int4": ("4x4", "2/int4"),
    "int8_bn8": ("4x4", "int8"), "chosen_4x4": ("4x4", None), "kernels_4x4": ("4x4", None),
    "search_4x4": ("4x4", None), "pool2_int4_bn4": ("0.15", "2/int4"), "int4_bn2": ("0.15", "int4"),
    "int2_bn4": ("0.15", "int2"), "chosen_0.15": ("0.15", None), "cosine_0.15": ("0.15", None),
    "search_0.15": ("0.15", None),
}
LEGACY = {
    "title": "Maps at a memory budget (resnet20, CIFAR-10)", "metric": "final_top1", "key": "top1", "scale": 100.0,
    "label": "top-1", "lower_is_better": False,
    "budgets": {"2x2": {"label": "uniform 2x2's bytes", "limit": None, "reference": "pool2"},
                "4x4": {"label": "uniform 4x4's bytes", "limit": None, "reference": "pool4"},
                "0.15": {"label": "0.15x stock", "limit": 0.15}},
    "configs": {c: {"home": home, "uniform": conv is not None} for c, (home, conv) in _LEGACY_CONFIGS.items()},
    "menu": "docs/results/criterion_check/menu/menu.json",
    "command": ("`python analysis/proof.py --out DIR --epochs E --train-subset N` (chosen maps copied into DIR/maps "
                "from the menu knapsack: `python analysis/menu_maps.py MENU.json --out ... --maps grad_error:0.547 "
                "grad_error:0.15 grad_error:0.547:kernels`; the `search_*` maps: the best of the menu search at "
                "that budget, run by the same command), `python analysis/proof_summary.py DIR`"),
    "search_note": ("Per-unit weights on the whole-gradient-error knapsack (every trial's map fits its budget); "
                    "trials train 2 epochs on the 10k subset with seed 100 and are scored on 5,000 held-out train "
                    "images (never the test set), median-pruned after epoch 1 (`sweeps/menu_resnet20.yaml`). "
                    "Trial 0 is the knapsack's own map at that budget."),
}


def layout_of(out: Path, table: dict | None = None) -> dict:
    """The proof's layout: ``<out>/proof.json`` (analysis/proof.py writes it; runs.json carries it),
    else ``LEGACY``."""
    return read(out, "proof.json", table) or LEGACY


def load(table: dict, layout: dict) -> dict[str, dict[int, dict]]:
    """config -> seed -> metrics of its finished runs."""
    return {config: runs for config in layout["configs"] if (runs := by_seed(table, config))}


def paired_t(diffs: list[float]) -> tuple[float, float]:
    """(t, two-sided p) of the mean of paired differences (scipy for p when installed)."""
    if len(diffs) < 2:
        return float("nan"), float("nan")
    sd = statistics.stdev(diffs)
    t = statistics.fmean(diffs) / (sd / math.sqrt(len(diffs))) if sd else math.copysign(math.inf, statistics.fmean(diffs))
    try:
        from scipy import stats
    except ImportError:
        return t, float("nan")
    return t, float(2 * stats.t.sf(abs(t), len(diffs) - 1)) if math.isfinite(t) else 0.0


def bootstrap_ci(diffs: list[float], resamples: int = 10000, seed: int = 0) -> list[float]:
    """95% percentile bootstrap interval of the mean of paired differences (seeds resampled)."""
    if len(diffs) < 2:
        return [math.nan, math.nan]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    return [means[int(0.025 * (resamples - 1))], means[int(0.975 * (resamples - 1))]]


def budget_limit(runs: dict[str, dict[int, dict]], spec: dict, out: Path, layout: dict) -> float:
    """A budget as a saved-bytes ratio: given, or measured by its uniform reference configuration
    (uniform pooling's bytes), else as the menu predicts it (exact: the menu's bytes are
    measure_memory's)."""
    if spec.get("limit") is not None:
        return float(spec["limit"])
    ratios = [r["ratio"] for r in runs.get(spec["reference"], {}).values()]
    if ratios:
        return max(ratios)
    return MenuResult.load(REPO / layout["menu"]).uniform(spec["reference"].removeprefix("pool"))["ratio"]


def diverged(metrics: dict) -> str | None:
    """Where a run diverged: the training loop's record, or for a run from before that guard, a
    non-finite final training loss (it trained on at NaN and was scored as it ended)."""
    if where := metrics.get("diverged"):
        return f"non-finite {where['in']} at epoch {where['epoch']}, step {where['step']}"
    loss = metrics.get("final_train_loss")
    return "non-finite training loss (trained on to the end)" if loss is not None and not math.isfinite(loss) else None


def costs(metrics: Iterable[dict]) -> dict:
    """What a configuration's runs cost: the largest whole-step peak over stock's (None where the runs
    predate that measurement) and the median over seeds of each run's median epoch in minutes (the
    median: an epoch cut by an interruption and resumed is timed twice)."""
    metrics = list(metrics)
    peaks = [m["step_peak_ratio"] for m in metrics if m.get("step_peak_ratio") is not None]
    epochs = [statistics.median(t) / 60 for m in metrics
              if (t := [h["epoch_time_s"] for h in m.get("history", []) if "epoch_time_s" in h])]
    return {"step_peak_ratio": max(peaks) if len(peaks) == len(metrics) else None,
            "minutes_per_epoch": statistics.median(epochs) if epochs else None}


def summarize(out: Path) -> dict:
    table = load_table(out)
    layout = layout_of(out, table)
    runs = load(table, layout)
    key, scale, sign = layout["key"], float(layout["scale"]), -1.0 if layout["lower_is_better"] else 1.0
    stock = runs.get("stock", {})
    # Runs trained once for another study (same map, schedule and seed): run -> where from.
    shared = {f"{config}/seed{seed}": m["reused_from"] for config in sorted(table["runs"])
              for seed, m in by_seed(table, config).items() if "reused_from" in m}
    result: dict = {"budgets": {}, "schedule": schedule(table["stock_config"]), "shared_runs": shared,
                    "searches": searches(out, table)}
    if layout is not LEGACY:
        result["layout"] = layout
    for budget, spec in layout["budgets"].items():
        limit = budget_limit(runs, spec, out, layout)
        rows = []
        for config, info in layout["configs"].items():
            if config == "stock" or config not in runs:
                continue
            seeds = sorted(runs[config])
            values = [scale * runs[config][s][layout["metric"]] for s in seeds]
            ratio = max(runs[config][s]["ratio"] for s in seeds)
            fits = ratio <= limit + 1e-9
            if not fits and info["home"] != budget:  # a config competes wherever its bytes fit
                continue
            failed = {s: where for s in seeds if (where := diverged(runs[config][s]))}
            rows.append({"config": config, "home": info["home"], "uniform": info["uniform"], "seeds": seeds,
                         **({"diverged": failed} if failed else {}), key: values, "mean": statistics.fmean(values),
                         "std": statistics.stdev(values) if len(values) > 1 else math.nan, "ratio": ratio, "fits": fits,
                         **costs(runs[config].values())})
        # The reference: the best uniform option among those run on the most seeds (a config still
        # missing seeds would be ranked on fewer, luckier or unluckier, seeds).
        fitting = [r for r in rows if r["uniform"] and r["fits"]]
        most = max((len(r["seeds"]) for r in fitting), default=0)
        uniform = [r for r in fitting if len(r["seeds"]) == most]
        best_uniform = max(uniform, key=lambda r: sign * r["mean"]) if uniform else None
        for row in rows:
            row["vs_stock"] = _paired(row, key, {s: scale * m[layout["metric"]] for s, m in stock.items()})
            if best_uniform is not None and row is not best_uniform:
                ref = dict(zip(best_uniform["seeds"], best_uniform[key], strict=True))
                row["vs_best_uniform"] = {**_paired(row, key, ref), "reference": best_uniform["config"]}
        result["budgets"][budget] = {"limit": limit, "rows": rows,
                                     "best_uniform": best_uniform["config"] if best_uniform else None}
    if stock:
        values = [scale * m[layout["metric"]] for m in stock.values()]
        result["stock"] = {"seeds": sorted(stock), "mean": statistics.fmean(values),
                           "std": statistics.stdev(values) if len(values) > 1 else math.nan, **costs(stock.values())}
    result = relative_to_repo(result)
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    reports = {s["dir"]: read(out, f"{s['dir']}/report.md", table) for s in result["searches"]}
    (out / "summary.md").write_text(markdown(result, relative_to_repo(layout), reports))
    plot_frontier(result, layout, out / "frontier.png")
    return result


def searches(out: Path, table: dict | None = None) -> list[dict]:
    """The menu searches' summaries (lessmem-search writes them; runs.json carries them), tightest
    budget first."""
    found = [read(out, name, table) | {"dir": name.rsplit("/", 1)[0]} for name in names(out, "search/b*/summary.json", table)]
    return sorted(found, key=lambda d: d["budget"])


def _paired(row: dict, key: str, reference: dict[int, float]) -> dict:
    common = [s for s in row["seeds"] if s in reference]
    diffs = [row[key][row["seeds"].index(s)] - reference[s] for s in common]
    t, p = paired_t(diffs)
    mean_ref = statistics.fmean(reference[s] for s in common) if common else math.nan
    mean_diff = statistics.fmean(diffs) if diffs else math.nan
    return {"seeds": common, "mean_diff": mean_diff, "t": t, "p": p, "diffs": diffs, "ci95": bootstrap_ci(diffs),
            "rel_pct": 100 * mean_diff / mean_ref if common and mean_ref else math.nan}


def _fmt(v: float, spec: str = "+.2f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def schedule(c: dict | None) -> str:
    """The training schedule, from the first stock run's config."""
    if not c:
        return "unknown (no stock run)"
    opt, data, model = c.get("optimizer", {}), c.get("dataset", {}), c.get("model", {})
    optimizer, scheduler = _named(opt), _named(c.get("scheduler", {}))
    if data.get("name", "cifar10") == "cifar10":
        images = (f"a balanced {data.get('train_subset')}-image CIFAR-10 subset" if data.get("train_subset")
                  else "all 50,000 CIFAR-10 training images")
        return (f"{model.get('name')}, {c.get('epochs')} epochs on {images}, batch {c.get('batch_size')}, "
                f"{optimizer} lr {opt.get('lr')}, {scheduler} schedule, full 10,000-image test set")
    lora = model.get("lora")
    tuned = (f"LoRA fine-tuning (r {lora.get('r')}, alpha {lora.get('lora_alpha')}) of {model.get('init_checkpoint')}, "
             if lora else "")
    return (f"{tuned}{model.get('name')}, {c.get('epochs')} epoch(s) of at most {c.get('max_steps_per_epoch')} steps "
            f"on {data.get('name')} (blocks of {data.get('seq_len')}), batch {c.get('batch_size')}, {optimizer} "
            f"lr {opt.get('lr')}, {scheduler} schedule, {data.get('val_blocks')} validation blocks")


def _named(group: dict) -> str | None:
    """A config group's name: its ``name``, else its Hydra ``_target_``'s last part."""
    return group.get("name") or (group.get("_target_") or "").rpartition(".")[2] or None


def _paired_cells(paired: dict, relative: bool = False) -> str:
    """A paired comparison's table cells: mean difference (``relative``: and as a percentage of the
    reference's mean, the unit of a perplexity target), p, 95% CI (dashes where it was not made)."""
    diff = _fmt(paired.get("mean_diff", math.nan))
    if relative and diff != "—":
        diff += f" ({_fmt(paired.get('rel_pct', math.nan), '+.1f')}%)"
    return f"{diff} | {_fmt(paired.get('p', math.nan), '.3f')} | {_ci(paired)}"


def _ci(paired: dict) -> str:
    lo, hi = paired.get("ci95", [math.nan, math.nan])
    return "—" if math.isnan(lo) else f"[{lo:+.2f}, {hi:+.2f}]"


def markdown(result: dict, layout: dict, reports: dict[str, str | None] | None = None) -> str:
    """summary.md; ``reports``: each search's report.md (by its folder), shown after the searches' table."""
    label, scale = layout["label"], float(layout["scale"])
    better = "lower is better" if layout["lower_is_better"] else "higher is better"
    percent = "; vs stock: also in % of stock's mean over the same seeds" if layout["lower_is_better"] else ""
    lines = [f"# {layout['title']}", "",
             f"Schedule: {result.get('schedule', 'unknown')}. Every configuration on the same seeds (paired); "
             f"{label}: {better}; p: two-sided paired t-test; 95% CI: bootstrap interval of the mean paired "
             f"difference (seeds resampled){percent}; step peak: the whole training step's peak over stock's; min/epoch: the "
             f"median epoch as measured on a machine shared with other runs (not a speed comparison: "
             f"benchmarks/speed.py times steps). Commands: {layout['command']}.", ""]
    if result.get("shared_runs"):
        lines += ["Runs trained once and shared with another study (same map, schedule and seed): "
                  + "; ".join(f"{run} ({source})" for run, source in result["shared_runs"].items()) + ".", ""]
    if "stock" in result:
        s = result["stock"]
        minutes = f", {s['minutes_per_epoch']:.1f} minutes an epoch" if s.get("minutes_per_epoch") else ""
        lines += [f"Stock: {s['mean']:.2f} ± {_fmt(s['std'], '.2f')} {label} over seeds {s['seeds']}{minutes}.", "",
                  "![memory vs metric frontier](frontier.png)", ""]
    if result.get("searches"):
        lines += ["## Menu searches (Optuna, one per budget)", "", layout["search_note"], "",
                  f"| budget (ratio) | trials (pruned) | distinct maps trained | knapsack map (held-out {label}) "
                  f"| best trial (held-out {label}) | best is the knapsack map | report |",
                  "|---:|---|---:|---:|---:|---|---|"]
        for sr in result["searches"]:
            k = sr.get("knapsack")
            knap = f"{scale * k['score']:.2f}" if k else "—"
            lines.append(f"| {sr['budget']:.4g} | {sr['complete_trials'] + sr['pruned_trials'] + sr.get('diverged_trials', 0)} ({sr['pruned_trials']}) | "
                         f"{sr['distinct_maps_trained']} | {knap} | trial {sr['best']['trial']}: "
                         f"{scale * sr['best']['score']:.2f} | {'yes' if sr['best_is_knapsack'] else 'no'} | "
                         f"{sr['dir']}, below |")
        lines.append("")
        for sr in result["searches"]:
            lines += search_report(sr["dir"], (reports or {}).get(sr["dir"]))
    key, relative = layout["key"], layout["lower_is_better"]
    for budget, data in result["budgets"].items():
        lines += [f"## Budget: {layout['budgets'][budget]['label']} (saved-bytes ratio <= {data['limit']:.3f})", ""]
        if not data["rows"]:
            lines += ["No configuration of this proof was run at this budget.", ""]
            continue
        lines += [f"| config | saved ratio | step peak | min/epoch | fits | seeds | {label} mean ± std | per seed "
                  "| vs stock (paired) | p | 95% CI | vs best uniform (paired) | p | 95% CI |",
                  "|---|---:|---:|---:|---|---|---:|---|---:|---:|---|---:|---:|---|"]
        for r in data["rows"]:
            vs_s, vs_u = r["vs_stock"], r.get("vs_best_uniform", {})
            marks = ["†" if seed in r.get("diverged", {}) else "" for seed in r["seeds"]]
            lines.append(
                f"| {r['config']} | {r['ratio']:.3f} | {_fmt(r.get('step_peak_ratio'), '.3f')} | "
                f"{_fmt(r.get('minutes_per_epoch'), '.1f')} | {'yes' if r['fits'] else 'no'} | {len(r['seeds'])} | "
                f"{r['mean']:.2f} ± {_fmt(r['std'], '.2f')} | "
                f"{', '.join(f'{v:.2f}{m}' for v, m in zip(r[key], marks, strict=True))} | "
                f"{_paired_cells(vs_s, relative)} | {_paired_cells(vs_u)} |")
        lines += [""]
        if any(r["uniform"] for r in data["rows"]):
            lines += [f"Best uniform option that fits: {data['best_uniform'] or 'none'}.", ""]
        if failed := [f"{r['config']} seed {seed}: {where}" for r in data["rows"]
                      for seed, where in r.get("diverged", {}).items()]:
            lines += ["† diverged (scored as the run ended): " + "; ".join(failed) + ".", ""]
    return "\n".join(lines) + "\n"


def search_report(folder: str, report: str | None) -> list[str]:
    """A search's report.md (lessmem-search wrote it: every trial's map score) one level down."""
    if not report:
        return []
    title, _, body = report.partition("\n")
    name = re.sub(r"^# (Menu )?[Ss]earch: ", "", title)
    body = re.sub(r"^(#+) ", r"\1## ", body.strip(), flags=re.M)
    return [f"### {folder}: {name}", "", body, ""]


def plot_frontier(result: dict, layout: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if "stock" in result:
        s = result["stock"]
        ax.errorbar([1.0], [s["mean"]], yerr=[s["std"]], fmt="k*", ms=10, label="stock")
    rows = {r["config"]: r for data in result["budgets"].values() for r in data["rows"]}
    colors = plt.cm.tab20.colors
    for i, r in enumerate(rows.values()):
        style = "o" if r["uniform"] else "*" if r["config"].startswith("search_") else "D"
        ax.errorbar([r["ratio"]], [r["mean"]], yerr=[0 if math.isnan(r["std"]) else r["std"]], fmt=style,
                    color=colors[i % len(colors)], ms=11 if style == "*" else 6, label=r["config"], capsize=3)
    for data in result["budgets"].values():
        if not math.isnan(data["limit"]):
            ax.axvline(data["limit"], color="grey", lw=0.6, ls=":")
    ax.set_xlabel("saved-for-backward bytes / stock")
    ax.set_ylabel(f"final {layout['label']}, mean ± std over seeds")
    ax.set_xscale("log")
    # two lines: a converged proof's title alone fills the width
    ax.set_title(f"{layout['title']}\no uniform, ◆ criterion's map, ★ searched map; dotted: budgets", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    summarize(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "results" / "budget_proof")
