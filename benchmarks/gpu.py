"""One command for a CUDA machine: memory and speed of stock PyTorch against lessmem, written
as a markdown table.

For each model, mode (eager, torch.compile), precision (fp32, AMP bf16) and configuration
(stock, 2x2, 4x4), one SGD training step is measured for
- saved bytes: what autograd keeps for backward (``lessmem.measure_memory``),
- whole-step peak: ``torch.cuda.max_memory_allocated`` over a step, and its split by category
  (``lessmem.measure_step_memory``),
- step time (median of ``--steps`` timed steps after ``--warmup``) and throughput.
Then the fused mask kernels (Triton on CUDA) against the torch reference, timed through a
compressed ReLU layer: forward (``clamp_and_pack``) and forward + backward (+ ``masked_grad``),
next to stock ``nn.ReLU``. A measurement that fails becomes a "failed" row (the exit status
says so) instead of ending the run.

Not yet run on a GPU (none was lent while it was written): only its CPU mode, below, is tested.
The default set compiles six models; on a fresh machine start with ``--modes eager``.

    python benchmarks/gpu.py --out docs/results/gpu.md          # resnet18, 224 px, batch 64
    python benchmarks/gpu.py --models resnet18 resnet50 --batch 128 --modes eager
    python benchmarks/gpu.py --device cpu --models resnet20 --size 16 --batch 2 --modes eager \\
        --steps 1 --warmup 1     # the same logic on the CPU (fused kernels: C++), as the tests run it
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn

import lessmem
from lessmem.core import training_step
from lessmem.models import build_model

CONFIGS: dict[str, dict[str, int | str] | None] = {
    "stock": None, "2x2": {"*": 2}, "4x4": {"*": 4}, "int2+int4bn": {"*": "int2"}, "int1+int2bn": {"*": "int1"}}
NORM_STORAGE = {"int2+int4bn": "int4", "int1+int2bn": "int2"}  # BatchNorm inputs of the low-bit maps
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
NUM_CLASSES = 1000
MIB = 2**20
# switches that send the mask kernels to the torch reference (read at each call)
REFERENCE_ENV = {"LESSMEM_TRITON": "0", "LESSMEM_CPU_KERNELS": "0"}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextlib.contextmanager
def torch_reference_kernels() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in REFERENCE_ENV}
    os.environ.update(REFERENCE_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


class Markdown:
    """Lines printed as they come (a long run shows progress) and kept for ``--out``."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failures = 0

    def add(self, *lines: str) -> None:
        self.lines += lines
        print("\n".join(lines), flush=True)

    def failed(self, prefix: str, error: Exception) -> None:
        """A failing measurement becomes a row: it must not cost the rest of a GPU session."""
        self.failures += 1
        message = " ".join(f"{type(error).__name__}: {error}".split()).replace("|", "/")[:160]
        self.add(f"{prefix} failed: {message} |")

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            f.write("\n".join(self.lines) + "\n")


def measure_step(stock: nn.Module, config: str, mode: str, precision: str, data: tuple, args) -> dict:
    """Saved bytes, whole-step peak and step time of one configuration; ``stock`` stays on the
    CPU so that the device holds only this configuration's model."""
    model = copy.deepcopy(stock).to(args.device)
    if CONFIGS[config] is not None:
        lessmem.compress(model, CONFIGS[config], norm_storage=NORM_STORAGE.get(config, "native"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    net = torch.compile(model) if mode == "compile" else model
    amp_dtype = PRECISIONS[precision]
    step = lessmem.measure_step_memory(net, data, optimizer=optimizer, amp_dtype=amp_dtype,
                                       warmup_steps=args.warmup)
    amp = torch.autocast(args.device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    with amp:
        saved = lessmem.measure_memory(net, data[0], train_step=False).total_bytes
    seconds = median_seconds(partial(training_step, net, data, optimizer, amp_dtype=amp_dtype),
                             args.device, args.steps, args.warmup)
    del model, net, optimizer
    release_memory(mode)
    return {"config": config, "saved_mib": saved / MIB, "peak_mib": step.peak_bytes / MIB,
            "phase": step.phase, "split": step.by_category, "step_ms": seconds * 1e3,
            "img_s": len(data[0]) / seconds}


def release_memory(mode: str) -> None:
    """Free what the last configuration left, so the next one's device peak is its own."""
    if mode == "compile":
        torch._dynamo.reset()  # compiled graphs keep the model they traced alive
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ratio(row: dict, stock: dict | None, key: str) -> str:
    return f"{row[key] / stock[key]:.3f}" if stock else "-"


def step_table(model_name: str, args, out: Markdown) -> None:
    torch.manual_seed(0)
    stock = build_model(model_name, NUM_CLASSES)
    data = (torch.randn(args.batch, 3, args.size, args.size, device=args.device),
            torch.randint(0, NUM_CLASSES, (args.batch,), device=args.device))
    out.add(f"\n### {model_name}, batch {args.batch}, {args.size}x{args.size}, SGD\n",
            "| mode | precision | config | saved MiB | saved ratio | step peak MiB | peak ratio | peak in | "
            "activations MiB | step ms | time ratio | img/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for precision in args.precisions:
            base = None
            for config in args.configs:
                try:
                    r = measure_step(stock, config, mode, precision, data, args)
                except Exception as e:
                    release_memory(mode)
                    out.failed(f"| {mode} | {precision} | {config} |", e)
                    continue
                base = r if config == "stock" else base
                out.add(f"| {mode} | {precision} | {config} | {r['saved_mib']:.1f} | {ratio(r, base, 'saved_mib')} | "
                        f"{r['peak_mib']:.1f} | {ratio(r, base, 'peak_mib')} | {r['phase']} | "
                        f"{r['split']['activations'] / MIB:.1f} | {r['step_ms']:.1f} | {ratio(r, base, 'step_ms')} | "
                        f"{r['img_s']:.1f} |")


def kernel_table(args, out: Markdown) -> None:
    """Time the compressed ReLU (fused kernels, then the torch reference) and stock nn.ReLU."""
    fused_name = "Triton" if args.device.type == "cuda" else "C++"
    packed = lessmem.compress(nn.Sequential(nn.ReLU()), None)  # ReLU that saves a 1-bit mask
    out.add(f"\n### mask kernels: ReLU layer, fused ({fused_name}) vs torch reference vs stock nn.ReLU\n",
            "| shape | dtype | pass | fused ms | reference ms | stock ms | reference / fused |",
            "|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(*args.kernel_shape, device=args.device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        passes: dict[str, Callable[[nn.Module], object]] = {
            "forward": lambda layer, x=x: layer(x),
            "forward + backward": lambda layer, x=x, grad=grad: layer(x).backward(grad),
        }
        for name, run in passes.items():
            def timed(layer: nn.Module, run: Callable[[nn.Module], object] = run) -> float:
                return median_seconds(lambda: run(layer), args.device, args.kernel_repeats, args.warmup) * 1e3
            prefix = f"| {tuple(args.kernel_shape)} | {str(dtype).removeprefix('torch.')} | {name} |"
            try:
                fused = timed(packed)
                with torch_reference_kernels():
                    reference = timed(packed)
                stock = timed(nn.ReLU())
            except Exception as e:
                out.failed(prefix, e)
                continue
            out.add(f"{prefix} {fused:.3f} | {reference:.3f} | {stock:.3f} | {reference / fused:.2f} |")


def header(device: torch.device) -> str:
    if device.type == "cuda":
        import triton

        where = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, Triton {triton.__version__}"
    else:
        where = "CPU (the check mode: not a GPU measurement)"
    return (f"# lessmem on {where}\n\ntorch {torch.__version__}; saved = what autograd keeps for backward; "
            "step peak = " + ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                              else "live tensor bytes (torch profiler)") + " over one SGD step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=torch.device, default=torch.device("cuda"))
    parser.add_argument("--models", nargs="+", default=["resnet18"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--modes", nargs="+", choices=["eager", "compile"], default=["eager", "compile"])
    parser.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (and compile)")
    parser.add_argument("--kernel-shape", type=int, nargs=4, default=[64, 64, 112, 112],
                        help="activation the mask kernels are timed on (resnet18's first, batch 64)")
    parser.add_argument("--kernel-repeats", type=int, default=50)
    parser.add_argument("--out", help="write the markdown here too")
    args = parser.parse_args(argv)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: use --device cpu to check the script on the CPU")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Markdown()
    out.add(header(args.device))
    for name in args.models:
        step_table(name, args, out)
    kernel_table(args, out)
    if args.out:
        out.write(args.out)
    if out.failures:
        raise SystemExit(f"{out.failures} measurement(s) failed: see the rows marked 'failed'")


if __name__ == "__main__":
    main()
