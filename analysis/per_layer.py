"""Per-block saved-for-backward bytes, stock vs compressed, for one model (CPU, random weights).

    python analysis/per_layer.py --model resnet18 --map '*=2' --batch 32 --size 224 --out docs/results/resnet18_per_layer
    python analysis/per_layer.py --model resnet20 --map '*=4' --batch 8 --size 32 --num-classes 10

Writes <out>.csv and <out>.png. Uses lessmem.measure_memory(...).per_layer, summed per block
(stem, layer1.0, ...): a storage shared by several modules is counted once, at the module that
saved it first, so module-level numbers are less meaningful than block sums.
"""

from __future__ import annotations

import argparse
import copy
import csv
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lessmem.core import compress, measure_memory
from lessmem.models import build_model
from lessmem.reporting import MiB, plot_per_layer


def block_of(layer: str) -> str:
    """``layer1.0.conv1`` -> ``layer1.0``; ``features.3.conv.0`` -> ``features.3``; ``bn1`` -> ``stem``
    (top-level modules before the first stage); ``''`` (functional ops) -> ``(functional)``."""
    if not layer:
        return "(functional)"
    parts = layer.split(".")
    if len(parts) >= 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    if parts[0] in ("conv1", "bn1", "relu", "maxpool"):
        return "stem"
    return parts[0]


def per_layer_memory(model_name: str, mapping: Mapping[str, Any], *, batch: int = 32, size: int = 224,
                     num_classes: int = 1000, compress_kwargs: Mapping[str, Any] | None = None,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Stock vs compressed saved bytes per block (``block_of``) of ``model_name``, with
    ``lessmem.core.measure_memory(...).per_layer``. Rows keep the model's block order."""
    torch.manual_seed(seed)
    model = build_model(model_name, num_classes=num_classes).train()
    x = torch.randn(batch, 3, size, size)
    stock = measure_memory(model, x).per_layer
    comp_model = compress(copy.deepcopy(model), dict(mapping), **dict(compress_kwargs or {}))
    comp = measure_memory(comp_model, x).per_layer
    order: OrderedDict[str, None] = OrderedDict()
    for name, _ in model.named_modules():
        if name:
            order[block_of(name)] = None
    sums: dict[str, list[int]] = {}
    for i, per in enumerate((stock, comp)):
        for layer, b in per.items():
            sums.setdefault(block_of(layer), [0, 0])[i] += b
    keys = [k for k in order if k in sums] + [k for k in sums if k not in order]
    return [{"block": k, "stock_bytes": sums[k][0], "compressed_bytes": sums[k][1]} for k in keys]


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
