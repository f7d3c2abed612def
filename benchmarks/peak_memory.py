"""Whole-step peak memory of stock PyTorch against lessmem, split by what the bytes hold.

One training step (forward, backward, optimizer step) per configuration, measured with
``lessmem.measure_step_memory``: on the CPU the peak of live tensor bytes from torch's memory
profiler (the allocations of torch's CPU allocator, not the process's resident memory), with
its split into parameters, gradients, optimizer state, activations, ... at that peak. Each
figure is checked against a second method: how far the process's resident memory rose over a
second, unprofiled step. From two batch sizes, each configuration's fixed and per-sample cost,
and from those the largest batch that fits under a memory cap; ``--check`` runs the predicted
batch (and a few more samples) to see that it does.

    python benchmarks/peak_memory.py     # resnet18 (SGD, AdamW), resnet50, mobilenet_v2; b32, b64; 224 px
    python benchmarks/peak_memory.py --runs resnet18:sgd --batches 32 64 --configs stock 2x2
    python benchmarks/peak_memory.py --csv docs/results/peak_memory.csv --plot docs/results/peak_memory.png
    python benchmarks/peak_memory.py --runs tiny_llama:adamw --seq 256 --batches 8 --configs stock lossy_int8

``--seq N``: causal-LM models (tiny_llama, tiny_gpt2) on token ids (batch, N) of a 256-token vocabulary
with the next-token loss, instead of images.

The script restarts itself with glibc's mmap threshold fixed (``FIXED_MMAP_ENV``): freed
tensors then go back to the OS at once, which the resident-memory check needs and which keeps
one large model's freed GiBs from piling up under the next one.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import sys
from dataclasses import dataclass
from functools import partial

import torch

import lessmem
from lessmem.core import FIXED_MMAP_ENV, peak_rss_growth, rebuildable_convs, training_step
from lessmem.models import build_model

CONFIGS: dict[str, dict[str, int | str] | None] = {
    "stock": None, "2x2": {"*": 2}, "4x4": {"*": 4}, "int2+int4bn": {"*": "int2"}, "int1+int2bn": {"*": "int1"},
    # every conv input after BatchNorm + ReLU / ReLU6 rebuilt in backward, not kept (``REBUILT``): exact, and
    # beside the paper's 2x2
    "exact+from_bn": {}, "2x2+from_bn": {"*": 2},
    # the same, every BatchNorm exact with the chunked backward (norm_storage "chunked")
    "2x2+chunked": {"*": 2}, "exact+from_bn+chunked": {}, "2x2+from_bn+chunked": {"*": 2},
    # causal LMs (--seq): every saved tensor int8, the ``lossy_int8`` preset
    "lossy_int8": {"*": "int8"}}
# lessmem.core.rebuildable_convs of the model, found on a small batch
REBUILT = ("exact+from_bn", "2x2+from_bn", "exact+from_bn+chunked", "2x2+from_bn+chunked")
NORM_STORAGE = {"int2+int4bn": "int4", "int1+int2bn": "int2", "lossy_int8": "int8",  # BatchNorm / norm inputs
                **dict.fromkeys(("2x2+chunked", "exact+from_bn+chunked", "2x2+from_bn+chunked"), "chunked")}
OTHER_STORAGES = {"lossy_int8": {"act_storage": "int8", "saved_storage": "int8"}}  # activations, the rest
VOCAB = 256  # token ids of the causal-LM models (--seq)
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "autograd_detail",
              "inputs", "temporaries", "unknown")
COLORS = ("darkgreen", "mediumblue", "goldenrod", "red", "royalblue", "black", "mediumpurple", "grey")
PAPER_REDUCTION = {"2x2": 0.29, "4x4": 0.36}  # resnet18 training step, total peak memory
NUM_CLASSES = 1000
MIB = 2**20
GIB = 2**30


def measure(model_name: str, optimizer_name: str, config: str, batch: int, size: int, seq: int | None = None) -> dict:
    """One row: the peak of a step and its split (MiB), and the resident-memory check. With ``seq``
    a causal LM on (batch, seq) token ids, else an image model on (batch, 3, size, size) images."""
    torch.manual_seed(0)
    model = build_model(model_name, VOCAB if seq else NUM_CLASSES)
    mapping = CONFIGS[config]
    if config in REBUILT:
        mapping = {**dict.fromkeys(rebuildable_convs(model, torch.randn(2, 3, 64, 64)), "from_bn"), **mapping}
    if mapping is not None:
        lessmem.compress(model, mapping, norm_storage=NORM_STORAGE.get(config, "native"), **OTHER_STORAGES.get(config, {}))
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    if seq:
        data = (torch.randint(0, VOCAB, (batch, seq)), torch.randint(0, VOCAB, (batch, seq)))
        loss_fn = next_token_loss
    else:
        data = (torch.randn(batch, 3, size, size), torch.randint(0, NUM_CLASSES, (batch,)))
        loss_fn = torch.nn.functional.cross_entropy
    report = lessmem.measure_step_memory(model, data, optimizer=optimizer, loss_fn=loss_fn)
    floor = start_of_backward_bytes(model, optimizer, data[0])
    model.zero_grad(set_to_none=True)  # as measure_step_memory starts its step
    rss = peak_rss_growth(partial(training_step, model, data, optimizer, loss_fn))
    del model, optimizer, data
    gc.collect()
    return {
        "model": model_name, "optimizer": optimizer_name, "batch": batch, "config": config,
        "peak_mib": report.peak_bytes / MIB, "phase": report.phase,
        **{c: report.by_category[c] / MIB for c in CATEGORIES},
        "growth_mib": (report.peak_bytes - report.start_bytes) / MIB, "rss_growth_mib": rss / MIB,
        "floor_mib": floor / MIB,
    }


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def start_of_backward_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> int:
    """A lower bound on the step's peak that no backward can go under: what is alive when backward
    starts (parameters, optimizer state, the batch, every saved tensor; ``measure_memory``'s
    independent count), before any gradient or backward buffer exists."""
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return (sum(t.numel() * t.element_size() for t in [*model.parameters(), *state, inputs])
            + lessmem.measure_memory(model, inputs).total_bytes)


@dataclass
class BatchFit:
    """Peak = fixed + per_sample x batch, through two measured batch sizes."""

    fixed_mib: float
    per_sample_mib: float

    @classmethod
    def through(cls, a: dict, b: dict) -> BatchFit:
        per_sample = (b["peak_mib"] - a["peak_mib"]) / (b["batch"] - a["batch"])
        return cls(a["peak_mib"] - per_sample * a["batch"], per_sample)

    def max_batch(self, cap_gib: float) -> int:
        return max(0, math.floor((cap_gib * GIB / MIB - self.fixed_mib) / self.per_sample_mib))


def batch_fits(rows: list[dict]) -> dict[tuple[str, str, str], BatchFit]:
    """(model, optimizer, config) -> fit through its smallest and largest measured batch."""
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["optimizer"], row["config"]), []).append(row)
    return {key: BatchFit.through(min(g, key=lambda r: r["batch"]), max(g, key=lambda r: r["batch"]))
            for key, g in groups.items() if len({r["batch"] for r in g}) > 1}


def print_peaks(rows: list[dict]) -> None:
    stock = {(r["model"], r["optimizer"], r["batch"]): r["peak_mib"] for r in rows if r["config"] == "stock"}
    print("| model | optimizer | batch | config | peak MiB | ratio to stock | peak in | "
          + " | ".join(c.replace("_", " ") for c in CATEGORIES) + " | step growth MiB | RSS growth MiB | start-of-backward floor MiB (ratio) |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|---|")
    for r in rows:
        base = stock.get((r["model"], r["optimizer"], r["batch"]))
        ratio = f"{r['peak_mib'] / base:.3f}" if base else "-"
        print(f"| {r['model']} | {r['optimizer']} | {r['batch']} | {r['config']} | {r['peak_mib']:.1f} | "
              f"{ratio} | {r['phase']} | " + " | ".join(f"{r[c]:.1f}" for c in CATEGORIES)
              + f" | {r['growth_mib']:.1f} | {r['rss_growth_mib']:.1f} | {r['floor_mib']:.1f}"
              + (f" ({r['floor_mib'] / base:.3f})" if base else "") + " |")


def print_paper_comparison(rows: list[dict]) -> None:
    """resnet18's whole-step reduction next to the paper's."""
    stock = {(r["optimizer"], r["batch"]): r["peak_mib"] for r in rows
             if r["model"] == "resnet18" and r["config"] == "stock"}
    lines = [f"| {r['optimizer']} | {r['batch']} | {r['config']} | {r['peak_mib'] / base - 1:+.1%} | "
             f"-{PAPER_REDUCTION[r['config']]:.0%} |"
             for r in rows if r["model"] == "resnet18" and r["config"] in PAPER_REDUCTION
             and (base := stock.get((r["optimizer"], r["batch"])))]
    if lines:
        print("\nresnet18, whole-step peak reduction against the paper's\n")
        print("| optimizer | batch | config | measured change | paper |")
        print("|---|---|---|---|---|")
        print("\n".join(lines))


def print_batch_fits(fits: dict[tuple[str, str, str], BatchFit], caps: list[float]) -> None:
    print("\nlargest batch under a memory cap, from peak = fixed + per-sample x batch\n")
    print("| model | optimizer | config | fixed MiB | per sample MiB | "
          + " | ".join(f"{cap:g} GiB" for cap in caps) + " |")
    print("|---|---|---|---|---|" + "---|" * len(caps))
    for (model, opt, config), fit in fits.items():
        stock = fits.get((model, opt, "stock"))
        cells = []
        for cap in caps:
            n = fit.max_batch(cap)
            gain = f" ({n / stock.max_batch(cap):.2f}x)" if stock and stock.max_batch(cap) and config != "stock" else ""
            cells.append(f"{n}{gain}")
        print(f"| {model} | {opt} | {config} | {fit.fixed_mib:.1f} | {fit.per_sample_mib:.2f} | "
              + " | ".join(cells) + " |")


def check_prediction(run: tuple[str, str], fits: dict[tuple[str, str, str], BatchFit], cap: float,
                     configs: list[str], size: int, seq: int | None = None) -> None:
    """Run each configuration at its predicted batch for ``cap`` and at ~5% more: the first
    should fit (peak <= cap), the second not."""
    print(f"\n{run[0]} ({run[1]}): the predicted batch for {cap:g} GiB, measured\n")
    print("| config | predicted batch | peak MiB | fits | batch + 5% | peak MiB | exceeds |")
    print("|---|---|---|---|---|---|---|")
    cap_mib = cap * GIB / MIB
    for config in configs:
        batch = fits[(*run, config)].max_batch(cap)
        more = batch + max(1, math.ceil(0.05 * batch))
        at, above = (measure(*run, config, b, size, seq)["peak_mib"] for b in (batch, more))
        print(f"| {config} | {batch} | {at:.1f} | {'yes' if at <= cap_mib else 'NO'} | {more} | "
              f"{above:.1f} | {'yes' if above > cap_mib else 'NO'} |", flush=True)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stock = {(r["model"], r["optimizer"], r["batch"]): r["peak_mib"] for r in rows if r["config"] == "stock"}
    labels = [f"{r['model']} {r['optimizer']} b{r['batch']} {r['config']}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.32 * len(rows)))
    left = [0.0] * len(rows)
    for category, color in zip(CATEGORIES, COLORS, strict=True):
        widths = [r[category] for r in rows]
        ax.barh(labels, widths, left=left, color=color, alpha=0.8, label=category.replace("_", " "))
        left = [a + w for a, w in zip(left, widths, strict=True)]
    for i, r in enumerate(rows):
        base = stock.get((r["model"], r["optimizer"], r["batch"]))
        if base and r["config"] != "stock":
            ax.text(r["peak_mib"], i, f" {r['peak_mib'] / base:.2f}x", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("live MiB at the step's peak (ratio: peak / stock peak)")
    ax.set_title("Whole-step peak memory by category (CPU, torch profiler)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def parse_run(text: str) -> tuple[str, str]:
    model, _, optimizer = text.partition(":")
    if optimizer not in OPTIMIZERS:
        raise argparse.ArgumentTypeError(f"expected MODEL:OPTIMIZER with OPTIMIZER in {list(OPTIMIZERS)}")
    return model, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", type=parse_run, metavar="MODEL:OPTIMIZER",
                        default=[("resnet18", "sgd"), ("resnet18", "adamw"), ("resnet50", "sgd"),
                                 ("mobilenet_v2", "sgd")])
    parser.add_argument("--batches", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--seq", type=int, default=None,
                        help=f"causal-LM models: token ids (batch, SEQ) of a {VOCAB}-token vocabulary instead of images")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--caps", nargs="+", type=float, default=[4, 8, 16], help="memory caps in GiB")
    parser.add_argument("--check", type=parse_run, metavar="MODEL:OPTIMIZER",
                        help="run this one's predicted batch at --check-cap")
    parser.add_argument("--check-cap", type=float, default=4, help="GiB")
    parser.add_argument("--csv", help="also write the rows as CSV here")
    parser.add_argument("--plot", help="stacked bars of the split at the peak, PNG")
    args = parser.parse_args()

    inputs = f"token ids x {args.seq}, {VOCAB}-token vocabulary" if args.seq else f"{args.size}x{args.size}, {NUM_CLASSES} classes"
    print(f"{inputs}, fp32, torch {torch.__version__}, CPU; "
          "peak = live tensor bytes (torch profiler); RSS growth = resident memory, unprofiled step")
    rows = []
    for model, opt in args.runs:
        for batch in args.batches:
            for config in args.configs:
                rows.append(measure(model, opt, config, batch, args.size, args.seq))
                print(f"measured {model} {opt} b{batch} {config}: {rows[-1]['peak_mib']:.1f} MiB",
                      file=sys.stderr, flush=True)
    print_peaks(rows)
    print_paper_comparison(rows)
    fits = batch_fits(rows)
    if fits:
        print_batch_fits(fits, args.caps)
    if args.check:
        check_prediction(args.check, fits, args.check_cap, args.configs, args.size, args.seq)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        plot(rows, args.plot)


def _restart_with_fixed_mmap_threshold() -> None:
    """glibc reads its malloc settings at process start, so set them and start again."""
    if any(os.environ.get(k) != v for k, v in FIXED_MMAP_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **FIXED_MMAP_ENV})


if __name__ == "__main__":
    _restart_with_fixed_mmap_threshold()
    main()
