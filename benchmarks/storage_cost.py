"""CPU time that the b-bit storages' packing and unpacking take in a training step, with the fused
C++ kernels and with the torch reference (``LESSMEM_CPU_KERNELS=0``), beside the step's own.

A compressed conv (or token linear) packs its pooled input, or at kernel 1 the whole input, in
forward and unpacks it in backward; this script times those calls (process CPU time, so other processes on a shared CPU disturb it little) during one
forward + backward after a warm-up step, for each spec of ``--maps`` (as the map {"*": SPEC}).

    python benchmarks/storage_cost.py --model resnet18 --size 64 --batch 16 --maps int8 int4 int1
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torchvision

import lessmem
from lessmem.core.ops import pooling

KERNELS_ENV = "LESSMEM_CPU_KERNELS"


class Timed:
    """Wraps ``fn`` and adds the CPU time of its calls to ``seconds``."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args):
        t0 = time.process_time()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.process_time() - t0


def measure(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, pack: Timed, unpack: Timed) -> tuple[float, ...]:
    """(pack s, unpack s, forward + backward s) of the second of two steps."""
    for _ in range(2):
        pack.seconds = unpack.seconds = 0.0
        t0 = time.process_time()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        step = time.process_time() - t0
    return pack.seconds, unpack.seconds, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--maps", nargs="+", default=["int8", "int4", "int1"], metavar="SPEC")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pack, unpack = Timed(pooling.pack_tensor), Timed(pooling.unpack_tensor)
    pooling.pack_tensor, pooling.unpack_tensor = pack, unpack  # where the layers call them

    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 10, (args.batch,))
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, fp32, {args.threads} threads, "
          f"CPU time of one forward + backward, torch {torch.__version__}")
    print("| map | packing | pack (ms) | unpack (ms) | step (ms) | share of step |")
    print("|---|---|---|---|---|---|")
    for spec in args.maps:
        model = lessmem.compress(build(args.model), {"*": spec})
        for label, env in (("fused", "1"), ("reference", "0")):
            os.environ[KERNELS_ENV] = env
            p, u, step = measure(model, x, y, pack, unpack)
            print(f"| {spec} | {label} | {p * 1e3:.1f} | {u * 1e3:.1f} | {step * 1e3:.0f} | {(p + u) / step:.1%} |")


def build(name: str) -> torch.nn.Module:
    from lessmem.models import MODELS, build_model

    if name in MODELS:
        return build_model(name, num_classes=10)
    return getattr(torchvision.models, name)(num_classes=10)


if __name__ == "__main__":
    main()
