"""Maps chosen from a storage-menu measurement (``lessmem-sensitivity`` writes ``menu.json``): the
least-criterion map within each budget, over the whole menu, the kernel-only one (pooling with
native storage, BatchNorm inputs kept exact: the paper's question with the new criterion) or the
unpooled one (stochastic codes only: pooling's bias on the weight gradient is what no criterion
measured on one step sees); ``step=R`` also recomputes the menu's regions where that lowers the
criterion, their predicted reruns within R stock steps (a menu measured with ``menu.recompute=true``).

    python analysis/menu_maps.py docs/results/criterion_check/menu/menu.json --out maps/ \
        --maps grad_error:0.15 grad_error:0.3 cosine:0.3 grad_error:0.547:kernels grad_error:0.08:unpooled

``--later MENU.json``: the same model's menu measured later (``sensitivity.checkpoint=`` a trained
run's checkpoint): for each map (and each ``--plans`` file) the criterion item by item on both menus,
largest later first, in ``<out>/later_<map>.md``: where a map chosen early errs once training has
gone on (docs/proofs.md, the tiny Llama at convergence).

    python analysis/menu_maps.py WARMUP/menu.json --out maps/ --maps tensor_error:0.12:step=1.15 \
        --plans chosen_0.12.yaml --later CONVERGED/menu.json
"""

from __future__ import annotations

import argparse
import copy
import math
from collections.abc import Callable
from pathlib import Path

from lessmem.core import FROM_NORM, CompressionPlan
from lessmem.sensitivity import (
    CRITERIA,
    DEFAULT_CRITERION,
    JOINT_KIND,
    MenuItem,
    MenuResult,
    ScoredPlan,
)
from lessmem.sensitivity.items import split_joint


def kernel_only(option: str) -> bool:
    """Native storage: exact or pooled without a code (not rebuilt: the paper's menu)."""
    return option == "native" or "/" not in option and not option.startswith(("bf16", "int")) and option != FROM_NORM


def unpooled(option: str) -> bool:
    """Kernel 1: exact or a stochastic code of the whole input."""
    return option == "1" or not option[0].isdigit()


NARROWINGS: dict[str, Callable[[str], bool]] = {"kernels": kernel_only, "unpooled": unpooled}


def narrowed(result: MenuResult, keeps: Callable[[str], bool]) -> MenuResult:
    """The same measurement restricted to the options ``keeps`` accepts."""
    kept = copy.deepcopy(result)
    for item in kept.items:
        keep = [j for j, option in enumerate(item.options) if _keeps(item, option, keeps)]
        item.options = [item.options[j] for j in keep]
        item.nbytes = [item.nbytes[j] for j in keep]
        item.criteria = {name: [[row[j] for j in keep] for row in rows] for name, rows in item.criteria.items()}
    return kept


def _keeps(item: MenuItem, option: str, keeps: Callable[[str], bool]) -> bool:
    """A BatchNorm x conv item's option is kept where both its parts are."""
    return all(keeps(part) for part in split_joint(option)) if item.kind == JOINT_KIND else keeps(option)


def later_table(plan: CompressionPlan, earlier: MenuResult, later: MenuResult, criterion: str) -> str:
    """Markdown: each item ``plan`` leaves lossy, its option and ``criterion`` as the knapsack sums it
    (``1 - cosine``, ``|loss_change|``) on both menus, the largest later value first, and the totals
    (a recomputed item: the error of what its rerun stores)."""
    before, after = earlier.item_values(plan, criterion), later.item_values(plan, criterion)
    rows = sorted(((n, o, v, after[n][1]) for n, (o, v) in before.items() if (v or after[n][1])),
                  key=lambda r: -r[3])
    summed = {"cosine": "1 - cosine", "loss_change": "|loss_change|"}.get(criterion, criterion)
    lines = [f"| item | option | {summed}, earlier menu | later menu | later / earlier |", "|---|---|---:|---:|---:|"]
    lines += [f"| {n} | {o} | {v:.3g} | {w:.3g} | {w / v if v else math.inf:.2f} |" for n, o, v, w in rows]
    total_before, total_after = sum(v for _, v in before.values()), sum(v for _, v in after.values())
    lines.append(f"| **total** ({len(rows)} items; {len(plan.recompute)} regions recomputed) | | **{total_before:.3g}** | "
                 f"**{total_after:.3g}** | {total_after / total_before if total_before else math.inf:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("menu", type=Path, help="menu.json of lessmem-sensitivity")
    p.add_argument("--out", type=Path, required=True, help="folder for the map files (and the --later tables)")
    p.add_argument("--maps", nargs="*", default=[],
                   help="criterion:budget[:kernels|:unpooled][:step=R], budget as a fraction of the stock saved bytes")
    p.add_argument("--plans", type=Path, nargs="*", default=[], help="map files to read on --later too")
    p.add_argument("--later", type=Path, default=None, help="the menu measured later: each map's items on both")
    p.add_argument("--criterion", default=DEFAULT_CRITERION, choices=CRITERIA, help="--later's criterion")
    args = p.parse_args(argv)
    if not args.maps and not args.plans:
        p.error("give --maps or --plans")
    if args.plans and args.later is None:
        p.error("--plans are read on --later's menu: give --later")
    args.out.mkdir(parents=True, exist_ok=True)
    result = MenuResult.load(args.menu)
    plans = {path.stem: CompressionPlan.read(path) for path in args.plans}
    for spec in args.maps:
        criterion, budget, *suffixes = spec.split(":")
        narrowing = [s for s in suffixes if s in NARROWINGS]
        steps = [s for s in suffixes if s.startswith("step=")]
        if len(narrowing) + len(steps) != len(suffixes) or len(narrowing) > 1 or len(steps) > 1:
            p.error(f"{spec!r}: suffixes are one of {', '.join(NARROWINGS)} and step=R")
        max_step = float(steps[0].removeprefix("step=")) if steps else 1.0
        source = narrowed(result, NARROWINGS[narrowing[0]]) if narrowing else result
        choice = source.make_map(float(budget), criterion, max_step_ratio=max_step)
        score = result.score(choice.plan)
        name = f"{criterion}_{budget}" + "".join(f"_{s.replace('=', '')}" for s in suffixes)
        recomputed = ScoredPlan(choice.plan, score).reruns_note()
        comment = (f"least {criterion} within {budget} x stock saved bytes ({narrowing[0] if narrowing else 'whole'} menu"
                   f"{f', step within {max_step:g}x' if steps else ''}), from {args.menu}\npredicted ratio "
                   f"{score['ratio']:.3f}; " + ", ".join(f"{c} {score[c]:.4g}" for c in ("grad_error", "cosine", "loss_change"))
                   + recomputed)
        path = choice.plan.replace(name=name).write(args.out / f"{name}.yaml", comment=comment)
        plans[name] = choice.plan
        print(f"{path}: ratio {score['ratio']:.3f}, grad_error {score['grad_error']:.4g}, cosine {score['cosine']:.4f}"
              + recomputed)
    if args.later is None:
        return
    later = MenuResult.load(args.later)
    for name, plan in plans.items():
        table = later_table(plan, result, later, args.criterion)
        path = args.out / f"later_{name}.md"
        path.write_text(f"# {name}: {args.criterion} item by item, {args.menu} against {args.later}\n\n{table}")
        print(f"{path}: total {table.splitlines()[-1]}")


if __name__ == "__main__":
    main()
