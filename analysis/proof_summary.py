"""Summary of analysis/proof.py runs: per budget, every configuration's final top-1 over the
same seeds, paired differences (same seed) against stock and against the best uniform option that
fits, a paired t-test, and the memory-vs-accuracy frontier plot. Writes ``<out>/summary.md``,
``summary.json`` and ``frontier.png``.

    python analysis/proof_summary.py docs/results/budget_proof
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from compact_runs import by_seed
from compact_runs import load as load_table
from proof import CONFIGS, MENU, search_budgets

from lessmem.sensitivity import MenuResult

BUDGETS = {"2x2": "uniform 2x2's bytes", "4x4": "uniform 4x4's bytes", "0.15": "0.15x stock"}


def load(table: dict) -> dict[str, dict[int, dict]]:
    """config -> seed -> metrics of its finished runs."""
    return {config: runs for config in CONFIGS if (runs := by_seed(table, config))}


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


def budget_limit(runs: dict[str, dict[int, dict]], budget: str) -> float:
    """The budget as a saved-bytes ratio: measured for the uniform pooling configurations, else
    as the menu predicts it (exact: the menu's bytes equal measure_memory's)."""
    if budget == "0.15":
        return 0.15
    ref = {"2x2": "pool2", "4x4": "pool4"}[budget]
    ratios = [r["ratio"] for r in runs.get(ref, {}).values()]
    return max(ratios) if ratios else search_budgets(MenuResult.load(MENU))[budget]


def summarize(out: Path) -> dict:
    table = load_table(out)
    runs = load(table)
    stock = runs.get("stock", {})
    # Runs trained once for another study (same map, schedule and seed): run -> where from.
    shared = {f"{config}/seed{seed}": m["reused_from"] for config in sorted(table["runs"])
              for seed, m in by_seed(table, config).items() if "reused_from" in m}
    result: dict = {"budgets": {}, "schedule": schedule(table["stock_config"]), "shared_runs": shared,
                    "searches": searches(out)}
    for budget in BUDGETS:
        limit = budget_limit(runs, budget)
        rows = []
        for config, (home, conv, _) in CONFIGS.items():
            if config == "stock" or config not in runs:
                continue
            seeds = sorted(runs[config])
            top1 = [100 * runs[config][s]["final_top1"] for s in seeds]
            ratio = max(runs[config][s]["ratio"] for s in seeds)
            fits = ratio <= limit + 1e-9
            if not fits and home != budget:  # a config competes wherever its bytes fit
                continue
            rows.append({"config": config, "home": home, "uniform": conv is not None, "seeds": seeds, "top1": top1,
                         "mean": statistics.fmean(top1), "std": statistics.stdev(top1) if len(top1) > 1 else math.nan,
                         "ratio": ratio, "fits": fits})
        # The reference: the best uniform option among those run on the most seeds (a config still
        # missing seeds would be ranked on fewer, luckier or unluckier, seeds).
        fitting = [r for r in rows if r["uniform"] and r["fits"]]
        most = max((len(r["seeds"]) for r in fitting), default=0)
        uniform = [r for r in fitting if len(r["seeds"]) == most]
        best_uniform = max(uniform, key=lambda r: r["mean"]) if uniform else None
        for row in rows:
            row["vs_stock"] = _paired(row, {s: 100 * m["final_top1"] for s, m in stock.items()})
            if best_uniform is not None and row is not best_uniform:
                ref = dict(zip(best_uniform["seeds"], best_uniform["top1"], strict=True))
                row["vs_best_uniform"] = {**_paired(row, ref), "reference": best_uniform["config"]}
        result["budgets"][budget] = {"limit": limit, "rows": rows,
                                     "best_uniform": best_uniform["config"] if best_uniform else None}
    if stock:
        top1 = [100 * m["final_top1"] for m in stock.values()]
        result["stock"] = {"seeds": sorted(stock), "mean": statistics.fmean(top1),
                           "std": statistics.stdev(top1) if len(top1) > 1 else math.nan}
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    (out / "summary.md").write_text(markdown(result))
    plot_frontier(result, out / "frontier.png")
    return result


def searches(out: Path) -> list[dict]:
    """The menu searches' summaries (lessmem-search writes them), tightest budget first."""
    found = [json.loads(p.read_text()) | {"dir": str(p.parent.relative_to(out))}
             for p in (out / "search").glob("b*/summary.json")]
    return sorted(found, key=lambda d: d["budget"])


def _paired(row: dict, reference: dict[int, float]) -> dict:
    common = [s for s in row["seeds"] if s in reference]
    diffs = [row["top1"][row["seeds"].index(s)] - reference[s] for s in common]
    t, p = paired_t(diffs)
    return {"seeds": common, "mean_diff": statistics.fmean(diffs) if diffs else math.nan, "t": t, "p": p,
            "diffs": diffs}


def _fmt(v: float, spec: str = "+.2f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def schedule(c: dict | None) -> str:
    """The training schedule, from the first stock run's config."""
    if not c:
        return "unknown (no stock run)"
    opt, data = c.get("optimizer", {}), c.get("dataset", {})
    return (f"{c.get('model', {}).get('name')}, {c.get('epochs')} epochs on a balanced {data.get('train_subset')}-image "
            f"CIFAR-10 subset, batch {c.get('batch_size')}, {opt.get('name')} lr {opt.get('lr')}, "
            f"{c.get('scheduler', {}).get('name')} schedule, full 10,000-image test set")


def markdown(result: dict) -> str:
    lines = ["# Maps at a memory budget (resnet20, CIFAR-10)", "",
             f"Schedule: {result.get('schedule', 'unknown')}. Every configuration on the same seeds (paired); "
             "p: two-sided paired t-test. Commands: `python analysis/proof.py --out DIR --epochs E "
             "--train-subset N` (chosen maps copied into DIR/maps from the menu knapsack: "
             "`python analysis/menu_maps.py MENU.json --out ... --maps grad_error:0.547 grad_error:0.15 "
             "grad_error:0.547:kernels`; the `search_*` maps: the best of the menu search at that budget, "
             "run by the same command), `python analysis/proof_summary.py DIR`.", ""]
    if result.get("shared_runs"):
        lines += ["Runs trained once and shared with another study (same map, schedule and seed): "
                  + "; ".join(f"{run} ({source})" for run, source in result["shared_runs"].items()) + ".", ""]
    if "stock" in result:
        s = result["stock"]
        lines += [f"Stock: {s['mean']:.2f} ± {_fmt(s['std'], '.2f')} top-1 over seeds {s['seeds']}.", "",
                  "![memory vs accuracy frontier](frontier.png)", ""]
    if result.get("searches"):
        lines += ["## Menu searches (Optuna, one per budget)", "",
                  "Per-unit weights on the whole-gradient-error knapsack (every trial's map fits its budget); trials "
                  "train 2 epochs on the 10k subset with seed 100 and are scored on 5,000 held-out train images "
                  "(never the test set), median-pruned after epoch 1 (`sweeps/menu_resnet20.yaml`). Trial 0 is the "
                  "knapsack's own map at that budget.", "",
                  "| budget (ratio) | trials (pruned) | distinct maps trained | knapsack map (held-out top-1) "
                  "| best trial (held-out top-1) | best is the knapsack map | report |",
                  "|---:|---|---:|---:|---:|---|---|"]
        for sr in result["searches"]:
            k = sr.get("knapsack")
            knap = f"{100 * k['score']:.2f}" if k else "—"
            lines.append(f"| {sr['budget']:.4g} | {sr['complete_trials'] + sr['pruned_trials']} ({sr['pruned_trials']}) | "
                         f"{sr['distinct_maps_trained']} | {knap} | trial {sr['best']['trial']}: "
                         f"{100 * sr['best']['score']:.2f} | {'yes' if sr['best_is_knapsack'] else 'no'} | "
                         f"[{sr['dir']}/report.md]({sr['dir']}/report.md) |")
        lines.append("")
    for budget, data in result["budgets"].items():
        lines += [f"## Budget: {BUDGETS[budget]} (saved-bytes ratio <= {data['limit']:.3f})", ""]
        if not data["rows"]:
            lines += ["No configuration of this proof was run at this budget.", ""]
            continue
        lines += ["| config | saved ratio | fits | seeds | top-1 mean ± std | per seed | vs stock (paired) "
                  "| vs best uniform (paired) | p |",
                  "|---|---:|---|---|---:|---|---:|---:|---:|"]
        for r in data["rows"]:
            vs_u = r.get("vs_best_uniform", {})
            lines.append(
                f"| {r['config']} | {r['ratio']:.3f} | {'yes' if r['fits'] else 'no'} | {len(r['seeds'])} | "
                f"{r['mean']:.2f} ± {_fmt(r['std'], '.2f')} | {', '.join(f'{v:.2f}' for v in r['top1'])} | "
                f"{_fmt(r['vs_stock']['mean_diff'])} | {_fmt(vs_u.get('mean_diff', math.nan))} | "
                f"{_fmt(vs_u.get('p', math.nan), '.3f')} |")
        lines += ["", f"Best uniform option that fits: {data['best_uniform']}.", ""]
    return "\n".join(lines) + "\n"


def plot_frontier(result: dict, path: Path) -> None:
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
    ax.set_xlabel("saved-for-backward bytes / stock (batch 32)")
    ax.set_ylabel("final top-1 (%), mean ± std over seeds")
    ax.set_xscale("log")
    ax.set_title("resnet20 CIFAR-10: o uniform, ◆ criterion's map, ★ searched map; dotted: budgets", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    summarize(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "docs" / "results" / "budget_proof")
