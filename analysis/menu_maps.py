"""Maps chosen from a storage-menu measurement (``lessmem-sensitivity`` writes ``menu.json``): the
least-criterion map within each budget, over the whole menu, the kernel-only one (pooling with
native storage, BatchNorm inputs kept exact: the paper's question with the new criterion) or the
unpooled one (stochastic codes only: pooling's bias on the weight gradient is what no criterion
measured on one step sees).

    python analysis/menu_maps.py docs/results/criterion_check/menu/menu.json --out maps/ \
        --maps grad_error:0.15 grad_error:0.3 cosine:0.3 grad_error:0.547:kernels grad_error:0.08:unpooled
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path

from lessmem.core import FROM_NORM
from lessmem.sensitivity import JOINT_KIND, MenuItem, MenuResult
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("menu", type=Path, help="menu.json of lessmem-sensitivity")
    p.add_argument("--out", type=Path, required=True, help="folder for the map files")
    p.add_argument("--maps", nargs="+", required=True,
                   help="criterion:budget[:kernels|:unpooled], budget as a fraction of the stock saved bytes")
    args = p.parse_args(argv)
    result = MenuResult.load(args.menu)
    for spec in args.maps:
        criterion, budget, *menu = spec.split(":")
        if menu and menu[0] not in NARROWINGS:
            p.error(f"{spec!r}: the menu suffix is one of {', '.join(NARROWINGS)}")
        source = narrowed(result, NARROWINGS[menu[0]]) if menu else result
        choice = source.make_map(float(budget), criterion)
        score = result.score(choice.plan)
        name = f"{criterion}_{budget}{f'_{menu[0]}' if menu else ''}"
        comment = (f"least {criterion} within {budget} x stock saved bytes ({menu[0] if menu else 'whole'} menu), "
                   f"from {args.menu}\npredicted ratio {score['ratio']:.3f}; "
                   + ", ".join(f"{c} {score[c]:.4g}" for c in ("grad_error", "cosine", "loss_change")))
        path = choice.plan.replace(name=name).write(args.out / f"{name}.yaml", comment=comment)
        print(f"{path}: ratio {score['ratio']:.3f}, grad_error {score['grad_error']:.4g}, cosine {score['cosine']:.4f}")


if __name__ == "__main__":
    main()
