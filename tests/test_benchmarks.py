"""The benchmark scripts run end to end on tiny inputs (their figures are not checked here:
timed claims live in docs/results, measured by these scripts)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_speed_benchmark_prints_a_ratio_per_configuration() -> None:
    out = _run("speed.py", "--model", "resnet18", "--size", "32", "--batch", "2", "--kernels", "1", "2",
               "--repeats", "1", "--warmup", "1")
    for config in ("stock", "1x1", "2x2"):
        assert re.search(rf"^\| {config} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), out


def test_profile_diff_lists_ops_of_both_models() -> None:
    out = _run("profile_diff.py", "32", "2", "1", "--rounds", "1", "--top", "40")
    assert re.search(r"^total: stock [\d.]+, 2x2 [\d.]+$", out, re.M), out
    assert "aten::convolution_backward" in out and "PooledConv2dFunction" in out
