"""Whole-step peak memory (``measure_step_memory``): what the CPU profiler replay counts, its
split by category, and a cross-check against the process's resident memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import lessmem
from lessmem.core import FIXED_MMAP_ENV, peak_rss_growth


def conv_stack(depth: int = 6) -> nn.Sequential:
    """Few parameters, many full-size activations: the peak is where backward starts."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(depth):
        layers += [nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def batch(n: int = 8, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, size, size), torch.randint(0, 10, (n,))


def nbytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_cpu_peak_is_its_categories_and_starts_from_the_training_state() -> None:
    model, data = conv_stack(), batch()
    optimizer = sgd(model)
    report = lessmem.measure_step_memory(model, data, optimizer=optimizer)
    params = nbytes(model.parameters())
    assert report.peak_bytes == sum(report.by_category.values())
    assert report.by_category["parameters"] == params
    assert report.by_category["optimizer_state"] == params  # one momentum buffer per parameter
    assert report.start_bytes == 2 * params + nbytes(model.buffers()) + nbytes(data)
    assert report.by_category["activations"] > params
    assert report.phase == "backward"
    assert report.method.startswith("profiler") and report.device == "cpu"


def test_compression_lowers_the_peak_where_activations_dominate() -> None:
    data = batch()
    stock = lessmem.measure_step_memory(m := conv_stack(), data, optimizer=sgd(m))
    packed = lessmem.measure_step_memory(m := lessmem.compress(conv_stack(), {"*": 2}), data, optimizer=sgd(m))
    assert packed.by_category["activations"] < 0.6 * stock.by_category["activations"]
    assert packed.ratio_to(stock) < 0.8


def test_adamw_state_makes_the_optimizer_step_the_peak() -> None:
    model = nn.Linear(512, 512)
    report = lessmem.measure_step_memory(model, (torch.randn(2, 512), torch.randint(0, 512, (2,))),
                                         optimizer=torch.optim.AdamW(model.parameters()))
    assert report.phase == "optimizer_step"
    assert report.by_category["optimizer_state"] >= 2 * nbytes(model.parameters())  # exp_avg, exp_avg_sq


def test_bf16_autocast_lowers_the_peak() -> None:
    model, data = conv_stack(), batch()
    fp32 = lessmem.measure_step_memory(model, data, optimizer=sgd(model))
    bf16 = lessmem.measure_step_memory(model, data, optimizer=sgd(model), amp_dtype=torch.bfloat16)
    assert bf16.peak_bytes < fp32.peak_bytes


def test_tracking_any_step_gives_the_same_peak_without_a_phase() -> None:
    model, data = conv_stack(), batch()
    optimizer = sgd(model)
    measured = lessmem.measure_step_memory(model, data, optimizer=optimizer)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(data[0]), data[1]).backward()
        optimizer.step()

    with lessmem.track_step_memory("cpu") as tracker:
        step()
    assert tracker.report is not None
    assert tracker.report.peak_bytes == measured.peak_bytes
    assert tracker.report.phase is None


RSS_CHECK = textwrap.dedent("""
    import torch, lessmem
    from lessmem.core import peak_rss_growth, training_step
    from tests.test_step_memory import batch, conv_stack, sgd
    model, data = conv_stack(), batch(n=16, size=64)
    optimizer = sgd(model)
    report = lessmem.measure_step_memory(model, data, optimizer=optimizer)
    model.zero_grad(set_to_none=True)
    rss = peak_rss_growth(lambda: training_step(model, data, optimizer))
    print(report.peak_bytes - report.start_bytes, rss)
""")


@pytest.mark.slow
def test_resident_memory_growth_agrees_with_the_profiler() -> None:
    """Second method: how far the process's resident set rose over an unprofiled step."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, **FIXED_MMAP_ENV, "PYTHONPATH": os.pathsep.join([root, *sys.path])}
    proc = subprocess.run([sys.executable, "-c", RSS_CHECK], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    profiled, rss = map(int, proc.stdout.split()[-2:])
    assert profiled > 20 * 2**20  # large against the resident-memory noise
    assert abs(rss - profiled) < 0.1 * profiled, (profiled, rss)


def test_resident_memory_warns_without_the_fixed_mmap_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in FIXED_MMAP_ENV:
        monkeypatch.delenv(key, raising=False)
    with pytest.warns(UserWarning, match="MALLOC_MMAP_THRESHOLD_"):
        assert peak_rss_growth(lambda: torch.ones(2**20).sum()) >= 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_peak_reads_max_memory_allocated() -> None:
    model, data = conv_stack().cuda(), tuple(t.cuda() for t in batch())
    report = lessmem.measure_step_memory(model, data, optimizer=sgd(model))
    assert report.method == "torch.cuda.max_memory_allocated"
    assert report.peak_bytes == torch.cuda.max_memory_allocated()
    # the allocator rounds blocks up, so its peak is at least the profiled tensor bytes
    assert report.peak_bytes >= sum(report.by_category.values())


def test_the_peak_report_lists_what_is_alive_at_the_peak() -> None:
    """``report.live`` names every tensor alive at the peak and ``format_live`` tables them: the rows
    and the remainder add up to the live bytes listed."""
    from lessmem.core.peak_tensors import format_live

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    batch = (torch.randn(512, 64), torch.randint(10, (512,)))
    report = lessmem.measure_step_memory(model, batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert report.live and sum(t.nbytes for t in report.live) <= report.peak_bytes
    table = format_live(report.live, min_bytes=2**16).splitlines()
    assert table[0].startswith("| MiB | category") and len(table) >= 4
    listed = [float(row.split("|")[1]) for row in table[2:]]
    assert sum(listed) == pytest.approx(sum(t.nbytes for t in report.live) / 2**20, abs=0.05 * len(listed))
