"""Per-block saved-for-backward bytes, stock vs compressed, for one model (CPU, random weights).

    python analysis/per_layer.py --model resnet18 --map '*=2' --batch 32 --size 224 --out docs/results/resnet18_per_layer
    python analysis/per_layer.py --model resnet20 --map '*=4' --batch 8 --size 32 --num-classes 10

Writes <out>.csv and <out>.png. Uses lessmem.measure_memory(...).per_layer, summed per block
(stem, layer1.0, ...): a storage shared by several modules is counted once, at the module that
saved it first, so module-level numbers are less meaningful than block sums.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from lessmem.reporting import MiB, per_layer_memory, plot_per_layer


def parse_map(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        pat, _, k = item.rpartition("=")
        if not pat:
            raise SystemExit(f"--map expects PATTERN=K, got {item!r}")
        out[pat] = int(k)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--map", nargs="+", default=["*=2"], help="PATTERN=K entries, first match wins")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--out", default=None, help="path prefix (default: per_layer_<model>)")
    args = p.parse_args(argv)
    mapping = parse_map(args.map)
    rows = per_layer_memory(args.model, mapping, batch=args.batch, size=args.size, num_classes=args.num_classes)
    out = Path(args.out or f"per_layer_{args.model}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["block", "stock_bytes", "compressed_bytes"])
        w.writeheader()
        w.writerows(rows)
    label = "lessmem " + ", ".join(f"{k}:{v}" for k, v in mapping.items())
    plot_per_layer(rows, out.with_suffix(".png"), label=label,
                   title=f"{args.model}, batch {args.batch}, {args.size}x{args.size}: stock vs {label}")
    stock, comp = sum(r["stock_bytes"] for r in rows), sum(r["compressed_bytes"] for r in rows)
    print(f"{args.model}: stock {stock / MiB:.1f} MiB, compressed {comp / MiB:.1f} MiB ({comp / stock:.3f})")
    print(f"{out.with_suffix('.csv')}\n{out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
