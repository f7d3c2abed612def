"""Saved-for-backward bytes of stock PyTorch against lessmem, same model and batch.

Counts unique storages of every tensor autograd keeps after the forward pass (parameters and
buffers excluded), with ``lessmem.measure_memory``. Runs on the CPU in minutes.

    python benchmarks/memory.py                       # resnet18, resnet50, mobilenet_v2; batch 32, 224x224
    python benchmarks/memory.py --models resnet18 --batch 8 --csv out.csv
    python benchmarks/memory.py --models vit_b_16     # transformer configs (VIT_CONFIGS)
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import multiprocessing as mp
import queue as queue_mod
from collections.abc import Iterator

import torch
import torchvision

import lessmem

# name -> (mapping, compress kwargs, note). "naive" is the trap: conv inputs pooled while ReLU and
# MaxPool still keep full-size tensors.
CONFIGS: dict[str, tuple[dict | None, dict, str]] = {
    "k=1": ({"*": 1}, {}, "exact: 1-bit ReLU masks, uint8 max-pool indices"),
    "naive 2x2": ({"*": 2}, {"exact_companions": False}, "conv inputs pooled only"),
    "2x2": ({"*": 2}, {}, "exact error propagation"),
    "4x4": ({"*": 4}, {}, "exact error propagation"),
    "2x2 + bf16 BN": ({"*": 2}, {"norm_storage": "bf16"}, "approximate BN input"),
    "4x4 + int8 BN": ({"*": 4}, {"norm_storage": "int8"}, "approximate BN input"),
}

# Transformers: linear inputs pooled over k tokens inside the encoder blocks (attention
# in-projection, MLP linears); patch embedding and head exact. Dropout masks as bits (k=1).
VIT_CONFIGS: dict[str, tuple[dict | None, dict, str]] = {
    "k=1": ({"*": 1}, {}, "exact: nothing pooled"),
    "tokens 2": ({"encoder.layers.*": 2}, {}, "exact error propagation"),
    "tokens 4": ({"encoder.layers.*": 4}, {}, "exact error propagation"),
    "tokens 2 + bf16 GELU": ({"encoder.layers.*": 2}, {"act_storage": "bf16"}, "approximate GELU input"),
    "tokens 4 + bf16 GELU": ({"encoder.layers.*": 4}, {"act_storage": "bf16"}, "approximate GELU input"),
}


def build(name: str) -> torch.nn.Module:
    return getattr(torchvision.models, name)(num_classes=1000)


def configs_of(name: str) -> dict[str, tuple[dict | None, dict, str]]:
    return VIT_CONFIGS if name.startswith("vit") else CONFIGS


def measure(name: str, batch: int, size: int, configs: list[str]) -> Iterator[dict]:
    """One row per configuration, yielded as soon as it is measured."""
    torch.manual_seed(0)
    stock = build(name)
    x = torch.randn(batch, 3, size, size)
    base = lessmem.measure_memory(stock, x).total_bytes
    yield dict(model=name, batch=batch, config="stock PyTorch", saved_mib=base / 2**20, ratio=1.0, note="")
    for cfg in configs:
        mapping, kwargs, note = configs_of(name)[cfg]
        model = lessmem.compress(copy.deepcopy(stock), mapping, **kwargs)
        saved = lessmem.measure_memory(model, x).total_bytes
        del model
        gc.collect()  # one model's saved tensors at a time: batch 32 of resnet50 is GiBs
        yield dict(model=name, batch=batch, config=cfg, saved_mib=saved / 2**20, ratio=saved / base, note=note)


def _measure_to_queue(queue, *args) -> None:
    for row in measure(*args):
        queue.put(row)
    queue.put(None)


def measure_in_subprocess(name: str, batch: int, size: int, configs: list[str]) -> Iterator[dict]:
    """``measure`` in a fresh process per model: the CPU allocator keeps the freed GiBs of one
    large model (resnet50 at batch 32) and the next one would run out of memory."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure_to_queue, args=(queue, name, batch, size, configs))
    proc.start()
    while True:
        try:
            row = queue.get(timeout=5)
        except queue_mod.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"measuring {name} died (exit code {proc.exitcode}; out of memory?)") from None
            continue
        if row is None:
            break
        yield row
    proc.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50", "mobilenet_v2"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS) + list(VIT_CONFIGS),
                        help="default: every config of the model's kind (CNN or ViT)")
    parser.add_argument("--csv", help="also write the table as CSV here")
    args = parser.parse_args()

    writer = None
    if args.csv:  # written row by row, so an interrupted run keeps what it measured
        csv_file = open(args.csv, "w", newline="")  # noqa: SIM115
        writer = csv.DictWriter(csv_file, fieldnames=["model", "batch", "config", "saved_mib", "ratio", "note"])
        writer.writeheader()
    print(f"batch {args.batch}, {args.size}x{args.size}, fp32, torch {torch.__version__}, "
          f"torchvision {torchvision.__version__}; saved-for-backward bytes after the forward pass")
    print("| model | config | saved MiB | ratio to stock | note |")
    print("|---|---|---|---|---|")
    try:
        for name in args.models:
            configs = [c for c in args.configs or configs_of(name) if c in configs_of(name)]
            for row in measure_in_subprocess(name, args.batch, args.size, configs):
                print(f"| {row['model']} | {row['config']} | {row['saved_mib']:.1f} | {row['ratio']:.3f} | "
                      f"{row['note']} |", flush=True)
                if writer:
                    writer.writerow(row)
                    csv_file.flush()
    except RuntimeError as e:  # a measuring process died: one line after the rows it measured
        raise SystemExit(f"memory.py: error: {e}") from None
    finally:
        if writer:
            csv_file.close()


if __name__ == "__main__":
    main()
