"""Which criterion predicts the trained metric? Reads the runs of analysis/criterion_check.py (resnet20)
or of ``analysis/proof.py --criterion-check N`` (any preset; its ``proof.json`` names the metric) and a
storage-menu measurement of the same model (``<out>/menu``: stock weights after warm-up on the same
schedule), scores every trained map with every criterion and ranks: Spearman's rho between the
final metric (top-1, or val_ppl with its sign turned: lower is better) and each criterion (sign
chosen so that +1 = perfect prediction), with the saved-bytes ratio itself as the baseline a
criterion must beat. Writes ``<out>/summary.md``, ``summary.json`` and ``scatter.png``.

    python analysis/criterion_summary.py docs/results/criterion_check
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from compact_runs import by_seed, load, read, restore_maps
from proof_summary import LEGACY, layout_of, schedule
from repo_paths import REPO, relative_to_repo

from lessmem.core import CompressionPlan
from lessmem.sensitivity import MenuResult

# criterion -> (label, +1 if larger predicts higher accuracy, log axis)
CRITERIA = {
    "grad_error": ("whole-gradient relative error", -1, True),
    "loss_change": ("first-order loss change", -1, True),
    "cosine": ("mean per-layer weight-gradient cosine", +1, False),
    "tensor_error": ("per-tensor relative error (mean over parameter tensors)", -1, True),
    "ratio": ("saved-bytes ratio (baseline: bytes alone)", +1, False),
}


def criteria_of(menu: MenuResult) -> dict[str, tuple[str, int, bool]]:
    """The criteria a menu was measured with, and the bytes baseline."""
    return {c: v for c, v in CRITERIA.items() if c == "ratio" or c in menu.criteria}


def kind_of(name: str) -> str:
    if name == "stock":
        return "stock"
    if name.startswith("random"):
        return "random"
    if name.startswith(tuple(c for c in CRITERIA if c != "ratio")):
        return "chosen"
    return "uniform"


def ranks(values: list[float]) -> list[float]:
    """Average ranks (ties share their mean rank)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else float("nan")


def bootstrap(rows: list[dict], criteria: dict[str, tuple[str, int, bool]], best: str, key: str, sign: float,
              resamples: int = 2000, seed: int = 0) -> dict[str, list[float]]:
    """95% bootstrap intervals (maps resampled with replacement) of each criterion's rho, and of
    its difference to the best one's: is the ranking of the criteria beyond the noise of one seed?"""
    import random

    rng = random.Random(seed)
    draws: dict[str, list[float]] = {c: [] for c in criteria} | {f"{c}-{best}": [] for c in criteria if c != best}
    for _ in range(resamples):
        sample = [rows[rng.randrange(len(rows))] for _ in rows]
        metric = [sign * r[key] for r in sample]
        rho = {c: c_sign * spearman([r[c] for r in sample], metric) for c, (_, c_sign, _) in criteria.items()}
        if any(math.isnan(v) for v in rho.values()):
            continue
        for c in criteria:
            draws[c].append(rho[c])
            if c != best:
                draws[f"{c}-{best}"].append(rho[c] - rho[best])
    return {k: [_quantile(v, 0.025), _quantile(v, 0.975)] for k, v in draws.items() if v}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def load_rows(out: Path, table: dict, menu: MenuResult, layout: dict) -> list[dict]:
    key, scale = layout["key"], float(layout["scale"])
    rows = []
    stock = by_seed(table, "stock")[0]
    rows.append({"map": "stock", "kind": "stock", key: scale * stock[layout["metric"]], "ratio": 1.0,
                 "predicted_ratio": menu.stock_bytes / menu.stock_bytes,
                 **{c: 1.0 if c == "cosine" else 0.0 for c in menu.criteria}})
    for path in sorted((out / "maps").glob("*.yaml")):
        m = by_seed(table, path.stem).get(0)
        if m is None:
            continue
        score = menu.score(CompressionPlan.read(path))
        rows.append({"map": path.stem, "kind": kind_of(path.stem), key: scale * m[layout["metric"]],
                     "ratio": m["ratio"], "predicted_ratio": score["ratio"],
                     **{c: score[c] for c in menu.criteria}})
    return rows


def summarize(out: Path) -> dict:
    table = load(out)
    layout = layout_of(out, table)
    own = read(out, "menu/menu.json", table)  # the folder's menu, or runs.json's copy
    menu = MenuResult.from_dict(own) if own is not None else MenuResult.load(REPO / layout["menu"])
    restore_maps(out, table)
    rows = load_rows(out, table, menu, layout)
    key, sign = layout["key"], -1.0 if layout["lower_is_better"] else 1.0
    metric = [sign * r[key] for r in rows]
    criteria = criteria_of(menu)
    rho = {c: c_sign * spearman([r[c] for r in rows], metric) for c, (_, c_sign, _) in criteria.items()}
    best = max((c for c in rho if c != "ratio"), key=lambda c: rho[c])
    result = relative_to_repo({"maps": len(rows), "rows": rows, "spearman": rho, "best": best, "meta": menu.meta,
                               "interval": bootstrap(rows, criteria, best, key, sign),
                               "schedule": schedule(table["stock_config"])})
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    (out / "summary.md").write_text(markdown(result, layout))
    plot(rows, rho, layout, out / "scatter.png")
    return result


def _intro(result: dict, layout: dict) -> str:
    if layout is not LEGACY:
        return (f"{result['maps']} maps (stock included), {layout['model']}, one seed each, the same schedule "
                f"({result.get('schedule', 'unknown')}); criteria predicted from one menu measurement "
                f"({result['meta'].get('weights')}). Maps: the knapsack's of every criterion at each budget, "
                f"uniform options, random per-unit draws over the menu in saved-bytes bins. Commands: "
                f"{layout['command']}.")
    return (f"{result['maps']} maps (stock included), resnet20 on CIFAR-10, one seed each, the same short schedule "
             f"({result.get('schedule', 'unknown')}); criteria predicted from one storage-menu measurement of the "
             "stock model after its first epoch. Maps: uniform, random per-layer draws over the whole menu in "
             "saved-bytes bins of 0.05 from 0.05 to 0.65, and knapsack choices (`grad_error_*`, `cosine_*`; "
             "`*_kernels`: the kernel-only menu). Commands: `python analysis/criterion_check.py --out DIR`, "
             "`lessmem-sensitivity model=resnet20 sensitivity.batches=4 "
             "sensitivity.batch_size=64 sensitivity.checkpoint=DIR/runs/stock/seed0/checkpoint_epoch1.pt "
             "sensitivity.out=DIR/menu`, `python analysis/criterion_summary.py DIR`.")


def markdown(result: dict, layout: dict) -> str:
    rho, key, label = result["spearman"], layout["key"], layout["label"]
    lines = [_intro(result, layout), "",
             f"| criterion | Spearman rho with final {label} (+1 = perfect) | 95% bootstrap interval | minus the best's rho (95%) |",
             "|---|---:|---|---|"]
    ci = result.get("interval", {})
    for c in rho:  # the criteria the menu has, then the bytes baseline
        lo, hi = ci.get(c, [math.nan, math.nan])
        dlo, dhi = ci.get(f"{c}-{result['best']}", [math.nan, math.nan])
        diff = "—" if c == result["best"] else f"[{dlo:+.3f}, {dhi:+.3f}]"
        lines.append(f"| {CRITERIA[c][0]} | {rho[c]:+.3f} | [{lo:+.3f}, {hi:+.3f}] | {diff} |")
    errors = [c for c in rho if c not in ("cosine", "ratio")]
    lines += ["", f"Best predictor: **{CRITERIA[result['best']][0]}**.", "",
              f"![final {label} against each criterion](scatter.png)", "",
              f"| map | kind | final {label} | saved ratio (measured) | predicted | {' | '.join(errors)} | cosine |",
              "|---|---|---:|---:|---:|" + "---:|" * (len(errors) + 1)]
    sign = -1.0 if layout["lower_is_better"] else 1.0
    for r in sorted(result["rows"], key=lambda r: -sign * r[key]):
        lines.append(f"| {r['map']} | {r['kind']} | {r[key]:.2f} | {r['ratio']:.3f} | {r['predicted_ratio']:.3f} | "
                     + "".join(f"{r[c]:.3g} | " for c in errors) + f"{r['cosine']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], rho: dict[str, float], layout: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"stock": "black", "uniform": "tab:blue", "random": "tab:orange", "chosen": "tab:green"}
    fig, axes = plt.subplots(1, len(rho), figsize=(4 * len(rho), 3.6), sharey=True)
    for ax, c in zip(axes, rho, strict=True):
        label, _, log = CRITERIA[c]
        for kind, color in colors.items():
            pts = [(r[c], r[layout["key"]]) for r in rows if r["kind"] == kind and (not log or r[c] > 0)]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=22, color=color, label=kind)
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(label, fontsize=8)
        ax.set_title(f"Spearman {rho[c]:+.2f}", fontsize=9)
    axes[0].set_ylabel(f"final {layout['label']}")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{layout.get('model', 'resnet20 CIFAR-10')}: does the criterion predict the metric? "
                 "(log axes omit exact maps)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    summarize(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "docs" / "results" / "criterion_check")
