"""``lessmem-coverage``: which saved tensors a configured model compresses and which stay full.

    lessmem-coverage model=resnet18 compression=pool2 dataset=synthetic dataset.image_size=224 \
        coverage.batch=32 coverage.out=outputs/coverage/resnet18

Arguments are Hydra overrides of ``conf/train.yaml`` plus ``coverage.KEY=VALUE``. Writes the
terminal table, ``coverage.csv``, ``coverage.json`` (rows + totals) and ``coverage.png`` (bytes
per layer, stacked: compressed vs full; the title gives the share of stock PyTorch).
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

import lessmem
from lessmem.compress.coverage import CoverageReport

_DEFAULTS = {"batch": None, "out": None, "full_only": False}


def coverage_for_config(cfg, batch: int | None = None) -> CoverageReport:
    """Coverage of the configured model and compression map on a random input batch (saved
    bytes depend on shapes only, not on pixel values)."""
    from lessmem.models import build_model_from_cfg
    from lessmem.train import compress_from_config, compression_map

    torch.manual_seed(int(cfg.get("seed", 0)))
    model = build_model_from_cfg(cfg).train()
    compress_from_config(model, compression_map(cfg.compression), cfg)
    size = int(cfg.dataset.image_size)
    x = torch.randn(int(batch or cfg.memory_batch), 3, size, size)
    return lessmem.coverage(model, x)


def save_report(report: CoverageReport, out: Path, title: str = "") -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "coverage.csv", "json": out / "coverage.json", "png": out / "coverage.png"}
    records = report.as_records()
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    paths["json"].write_text(json.dumps({"summary": report.summary(), "rows": records}, indent=1))
    plot_layers(report, paths["png"], title)
    return paths


def plot_layers(report: CoverageReport, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compressed: dict[str, int] = defaultdict(int)
    full: dict[str, int] = defaultdict(int)
    for r in report.rows:
        (compressed if r.compressed else full)[r.layer] += r.bytes
    layers = list(dict.fromkeys(r.layer for r in report.rows))
    mib = 2**20
    fig, ax = plt.subplots(figsize=(max(8, 0.22 * len(layers)), 4.5))
    xs = range(len(layers))
    full_v = [full[n] / mib for n in layers]
    ax.bar(xs, full_v, color="#d62728", label="kept full size")
    ax.bar(xs, [compressed[n] / mib for n in layers], bottom=full_v, color="#2ca02c",
           label="compressed (pooled / bits / uint8)")
    ax.set_xticks(list(xs), layers, rotation=90, fontsize=6)
    ax.set_ylabel("saved for backward (MiB)")
    s = report.summary()
    note = f"total {s['total_bytes'] / mib:.1f} MiB"
    if s["stock_bytes"]:
        note += f" = {s['share_of_stock']:.3f}x stock; exact-propagation floor {s['floor_share_of_stock']:.3f}x"
    ax.set_title(f"{title}\n{note}" if title else note, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    from hydra.errors import HydraException

    from lessmem.sensitivity import compose_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    hydra_args, opts = [], dict(_DEFAULTS)
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key.startswith("coverage."):
            name = key.split(".", 1)[1]
            if name not in _DEFAULTS:
                print(f"lessmem-coverage: unknown option {arg!r}; coverage.* options: {sorted(_DEFAULTS)}",
                      file=sys.stderr)
                return 2
            opts[name] = value
        else:
            hydra_args.append(arg)
    try:
        cfg = compose_config(hydra_args)
        report = coverage_for_config(cfg, int(opts["batch"]) if opts["batch"] else None)
    except (ValueError, FileNotFoundError, KeyError, HydraException) as e:
        print(f"lessmem-coverage: error: {e}", file=sys.stderr)
        return 2
    print(report.table(full_only=str(opts["full_only"]).lower() == "true"))
    name = f"{cfg.model.name} / {cfg.compression.get('name', 'custom')}"
    out = Path(opts["out"] or f"outputs/coverage/{cfg.model.name}_{cfg.compression.get('name', 'custom')}")
    for kind, path in save_report(report, out, name).items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
