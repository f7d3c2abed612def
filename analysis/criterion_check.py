"""Does a sensitivity criterion predict accuracy? Train many compression maps the same short way and
rank them by accuracy and by each criterion (issue 19, item 3).

Maps (resnet20, CIFAR-10): stock, uniform ones (pooling, quantization, both, with BatchNorm storage),
random per-layer maps over the whole menu (kernel x storage per conv input, storage per BatchNorm
input) spread over 0.05-0.65x stock saved bytes, and the maps the criteria choose (``--extra`` map
files). Every map trains the same short way: seed 0, a fixed balanced subset, full test set.

    python analysis/criterion_check.py --out docs/results/criterion_check --workers 2   # train
    python analysis/criterion_check.py --out docs/results/criterion_check --extra a.yaml b.yaml

The ranking (Spearman's rho of accuracy against each criterion) is written by
``analysis/criterion_summary.py``.
"""

from __future__ import annotations

import argparse
import copy
import random
from pathlib import Path

import yaml
from jobs import REPO, Job, schedule, train_job

KERNELS = (1, 2, 4, 8)
STORAGES = ("native", "bf16", "int8", "int4", "int2", "int1")
UNIFORM = {  # name -> (conv spec, BatchNorm storage)
    "pool2": ("2", "native"), "pool4": ("4", "native"), "int8": ("int8", "native"),
    "pool2_int4": ("2/int4", "native"), "int8_bn8": ("int8", "int8"), "int4_bn4": ("int4", "int4"),
    "pool2_int8_bn8": ("2/int8", "int8"), "pool2_int4_bn4": ("2/int4", "int4"),
}
BINS = [(0.05 + 0.05 * i, 0.10 + 0.05 * i) for i in range(12)]  # random maps: one per ratio bin


def saved_ratio(conv: dict[str, str], norm: dict[str, str] | str) -> float:
    import torch

    import lessmem
    from lessmem.models import build_model

    torch.manual_seed(0)
    model = build_model("resnet20", num_classes=10).train()
    x = torch.randn(32, 3, 32, 32)
    stock = lessmem.measure_memory(model, x)
    compressed = lessmem.compress(copy.deepcopy(model), conv, norm_storage=norm)
    return lessmem.measure_memory(compressed, x).ratio_to(stock)


def random_maps(seed: int) -> dict[str, tuple[dict[str, str], dict[str, str], float]]:
    """One random map per ratio bin: per item an option drawn around a per-map aggressiveness."""
    import torch

    import lessmem
    from lessmem.models import build_model

    model = build_model("resnet20", num_classes=10)
    convs = list(lessmem.compressible_layers(model))
    norms = [n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    conv_options = sorted(((k, s) for k in KERNELS for s in STORAGES), key=lambda o: _bits(o[1]) / o[0] ** 2,
                          reverse=True)
    norm_options = list(STORAGES[:-1])  # 1-bit BatchNorm inputs are left out: they diverge
    rng = random.Random(seed)
    found: dict[str, tuple[dict[str, str], dict[str, str], float]] = {}
    for _ in range(400):
        if len(found) == len(BINS):
            break
        level = rng.random()
        conv = {n: _spec(*_pick(rng, conv_options, level, 4.0)) for n in convs}
        norm = {n: str(_pick(rng, norm_options, level, 1.0)) for n in norms}
        ratio = saved_ratio(conv, norm)
        for i, (lo, hi) in enumerate(BINS):
            if lo <= ratio < hi and f"random{i:02d}" not in found:
                found[f"random{i:02d}"] = (conv, norm, ratio)
    return dict(sorted(found.items()))


def _pick(rng: random.Random, options: list, level: float, spread: float):
    """An option around position ``level`` (0 = first, 1 = last) of ``options``."""
    i = round(level * (len(options) - 1) + rng.gauss(0, spread))
    return options[min(max(i, 0), len(options) - 1)]


def _bits(storage: str) -> float:
    return {"native": 32, "bf16": 16}.get(storage, 0) or int(storage[3:]) + 0.5


def _spec(k: int, storage: str) -> str:
    return str(k) if storage == "native" else f"{k}/{storage}"


def write_maps(out: Path, seed: int) -> list[Path]:
    maps_dir = out / "maps"
    maps_dir.mkdir(parents=True, exist_ok=True)
    files = []
    entries: dict[str, tuple[dict, object, float | None]] = {
        name: ({"*": conv}, norm, None) for name, (conv, norm) in UNIFORM.items()}
    if not any(maps_dir.glob("random*.yaml")):
        entries.update({n: (c, b, r) for n, (c, b, r) in random_maps(seed).items()})
    for name, (conv, norm, ratio) in entries.items():
        path = maps_dir / f"{name}.yaml"
        if not path.exists():
            header = f"# criterion check map; saved-bytes ratio {ratio:.3f} (resnet20 b32)\n" if ratio else ""
            body = {"name": name, "exact_companions": True, "norm_storage": norm, "map": conv}
            path.write_text(header + yaml.safe_dump(body, sort_keys=False))
    files = sorted(maps_dir.glob("*.yaml"))
    return files


def jobs_for(out: Path, maps: list[Path], args: argparse.Namespace) -> list[Job]:
    common = ["model=resnet20", "dataset=cifar10", "logger=csv", "device=cpu", f"epochs={args.epochs}",
              "batch_size=128", "channels_last=true", "memory_batch=32",
              f"dataset.train_subset={args.train_subset}"]
    jobs = [train_job(out, "stock", 0, ["compression=none"], common, keep=True)]
    for path in maps:
        jobs.append(train_job(out, path.stem, 0, ["compression=pool2", f"compression.map_file={path}",
                                                  f"compression.name={path.stem}"], common))
    return jobs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "criterion_check")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--train-subset", type=int, default=10000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--map-seed", type=int, default=0, help="seed of the random maps")
    p.add_argument("--extra", type=Path, nargs="*", default=[], help="more map files to train (copied in)")
    p.add_argument("--maps-only", action="store_true", help="write the map files, train nothing")
    args = p.parse_args()
    out = args.out.resolve()
    maps = write_maps(out, args.map_seed)
    for extra in args.extra:
        dest = out / "maps" / extra.name
        if not dest.exists():
            dest.write_text(extra.read_text())
    maps = sorted((out / "maps").glob("*.yaml"))
    print(f"{len(maps)} maps in {out / 'maps'}", flush=True)
    if not args.maps_only:
        schedule(jobs_for(out, maps, args), args.workers, args.threads, out)


if __name__ == "__main__":
    main()
