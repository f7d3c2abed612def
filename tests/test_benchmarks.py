"""The benchmark scripts run end to end on tiny inputs, in this process, as ``python
benchmarks/<script> ARGS`` would (their figures are not checked here: timed claims live in
docs/results, measured by these scripts)."""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/<script>`` as a module, importable for the test's duration."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{Path(script).stem}", BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., tuple[int, str, str]]]:
    """``bench(script, *args)``: the script's ``main()`` under ``sys.argv``; (exit status, stdout,
    stderr). The scripts may set torch's thread count and environment variables (storage_cost.py
    switches LESSMEM_CPU_KERNELS): both are restored afterwards."""
    threads, environ = torch.get_num_threads(), dict(os.environ)

    def run(script: str, *args: str) -> tuple[int, str, str]:
        module = load_benchmark(script, monkeypatch)
        monkeypatch.setattr(sys, "argv", [script, *args])
        capsys.readouterr()
        try:
            module.main()
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return status, out, err

    yield run
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture
def stdout_of(bench: Callable[..., tuple[int, str, str]]) -> Callable[..., str]:
    """``stdout_of(script, *args)``: the script's stdout, after a zero exit status."""
    def run(script: str, *args: str) -> str:
        status, out, err = bench(script, *args)
        assert status == 0, err[-2000:]
        return out

    return run


def test_speed_benchmark_prints_a_ratio_per_configuration(stdout_of) -> None:
    out = stdout_of("speed.py", "--model", "resnet18", "--size", "32", "--batch", "2", "--kernels", "1", "2",
               "--repeats", "1", "--warmup", "1")
    for config in ("stock", "1x1", "2x2"):
        assert re.search(rf"^\| {config} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), out


def test_speed_benchmark_times_spec_maps_beside_kernels(stdout_of) -> None:
    out = stdout_of("speed.py", "--model", "resnet18", "--size", "32", "--batch", "2", "--kernels", "2",
               "--maps", "2", "int8", "2/int4", "--repeats", "1", "--warmup", "1", "--clock", "cpu")
    rows = re.findall(r"^\| (\S+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M)
    assert rows == ["stock", "2x2", "1x1/int8", "2x2/int4"], out  # "2" is the 2x2 of --kernels


def test_speed_benchmark_times_a_whole_map(stdout_of) -> None:
    out = stdout_of("speed.py", "--model", "resnet18", "--size", "32", "--batch", "2", "--maps",
                    "layer*.conv2:from_bn,*:int2", "--norm-storage", "int4", "--repeats", "1", "--warmup", "1")
    assert re.search(r"^\| layer\*\.conv2:from_bn,\*:int2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), out


def test_speed_benchmark_times_a_map_file_with_its_storages(tmp_path: Path, stdout_of, bench) -> None:
    plan = tmp_path / "small.yaml"
    plan.write_text("name: small\nmap:\n  layer1.*.conv2: from_bn\n  '*': int2\nnorm_storage: int4\n")
    out = stdout_of("speed.py", "--model", "resnet18", "--size", "32", "--batch", "2", "--map-file", str(plan),
                    "--repeats", "1", "--warmup", "1", "--clock", "user")
    rows = re.findall(r"^\| (\S+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M)
    assert rows == ["stock", "small"], out  # no default kernels beside a map file
    status, _, err = bench("speed.py", "--map-file", str(tmp_path / "missing.yaml"))
    assert status == 2 and "--map-file" in err and "does not exist" in err


def test_speed_benchmark_names_a_bad_spec(bench) -> None:
    status, _, err = bench("speed.py", "--maps", "2/int3")
    assert status == 2 and "--maps 2/int3" in err and "unknown storage 'int3'" in err


def test_storage_cost_times_fused_and_reference_packing(stdout_of) -> None:
    out = stdout_of("storage_cost.py", "--model", "resnet20", "--size", "16", "--batch", "2", "--maps", "int4", "2/int8")
    for spec in ("int4", "2/int8"):
        for packing in ("fused", "reference"):
            assert re.search(rf"^\| {spec} \| {packing} \| [\d.]+ \| [\d.]+ \| \d+ \| [\d.]+% \|$", out, re.M), out


def test_speed_profile_lists_the_ops_of_both_models_by_their_difference(stdout_of) -> None:
    out = stdout_of("speed.py", "--model", "resnet20", "--size", "16", "--batch", "2", "--kernels", "2", "--repeats", "1",
                    "--warmup", "0", "--profile", "2", "--profile-rounds", "1", "--profile-top", "40")
    assert re.search(r"^total: stock [\d.]+, 2x2 [\d.]+$", out, re.M), out
    assert "aten::convolution_backward" in out and "PooledConv2dFunction" in out
    moved = [abs(float(line.split()[0])) for line in out.splitlines() if re.match(r"^\s*[+-]\d+\.\d+  ", line)]
    assert len(moved) == 40 and moved == sorted(moved, reverse=True)


@pytest.mark.slow
def test_peak_memory_benchmark_tables_fits_check_csv_and_plot(tmp_path: Path, stdout_of) -> None:
    csv_path, png = tmp_path / "peak.csv", tmp_path / "peak.png"
    out = stdout_of("peak_memory.py", "--runs", "resnet20:sgd", "--batches", "2", "4", "--size", "16",
               "--configs", "stock", "2x2", "--caps", "0.05", "--check", "resnet20:sgd",
               "--check-cap", "0.02", "--csv", str(csv_path), "--plot", str(png))
    for batch in (2, 4):
        for config in ("stock", "2x2"):
            assert re.search(rf"^\| resnet20 \| sgd \| {batch} \| {config} \| [\d.]+ \| [\d.]+ \| \w+ \|", out, re.M), out
    assert re.search(r"^\| resnet20 \| sgd \| 2x2 \| [\d.-]+ \| [\d.]+ \| \d+ \([\d.]+x\) \|$", out, re.M), out
    assert re.search(r"^\| 2x2 \| \d+ \| [\d.]+ \| (yes|NO) \| \d+ \| [\d.]+ \| (yes|NO) \|$", out, re.M), out
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 4
    assert all(0 < float(r["floor_mib"]) <= float(r["peak_mib"]) for r in rows), rows  # a lower bound
    assert png.stat().st_size > 0


@pytest.mark.slow
def test_peak_memory_benchmark_measures_a_causal_lm(stdout_of) -> None:
    out = stdout_of("peak_memory.py", "--runs", "tiny_llama:adamw", "--seq", "64", "--batches", "4",
                    "--configs", "stock", "lossy_int8")
    assert out.startswith("token ids x 64, 256-token vocabulary"), out
    ratio = re.search(r"^\| tiny_llama \| adamw \| 4 \| lossy_int8 \| [\d.]+ \| ([\d.]+) \| \w+ \|", out, re.M)
    assert ratio and 0 < float(ratio.group(1)) < 1, out


@pytest.mark.slow
def test_gpu_benchmark_runs_its_cpu_mode_and_writes_markdown(tmp_path: Path, stdout_of) -> None:
    md = tmp_path / "gpu.md"
    out = stdout_of("gpu.py", "--device", "cpu", "--models", "resnet20", "--size", "16", "--batch", "2",
               "--modes", "eager", "--configs", "stock", "2x2", "--steps", "1", "--warmup", "1",
               "--kernel-shape", "2", "8", "16", "16", "--kernel-repeats", "2", "--out", str(md))
    assert md.read_text().strip() == out.strip()
    for precision in ("fp32", "bf16"):
        assert re.search(rf"^\| eager \| {precision} \| 2x2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \w+ \|", out, re.M), out
    assert re.search(r"^\| \(2, 8, 16, 16\) \| float32 \| forward \+ backward \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$",
                     out, re.M), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message is for machines without CUDA")
def test_gpu_benchmark_asks_for_cpu_mode_without_cuda(bench) -> None:
    status, _, err = bench("gpu.py")
    assert status == 2 and "--device cpu" in err


def test_zoo_benchmark_prints_a_ratio_beside_the_issues(stdout_of) -> None:
    pytest.importorskip("timm")
    pytest.importorskip("transformers")
    out = stdout_of("zoo.py", "--models", "hf_bert", "--batch", "1", "--tokens", "32")
    cells = r"\| [\d.]+ \| 0\.\d{3} \| 0\.913 \| <= 0\.85 \| [\d.]+ \| 0\.\d{3} \| [\d.]+ \| [\d.]+ \|$"
    assert re.search(rf"^\| hf_bert {cells}", out, re.M), out


@pytest.mark.slow
def test_budget_benchmark_exact_view_csv_and_plot(tmp_path: Path, stdout_of) -> None:
    csv_path, png = tmp_path / "resnet20.csv", tmp_path / "exact.png"
    out = stdout_of("budget.py", "--model", "resnet20", "--image-size", "32", "--batch", "16", "--steps", "1",
                    "--exact", "0.8", "0.1", "--no-compile", "--csv", str(csv_path))
    assert re.search(r"^resnet20 b16: stock peak [\d.]+ MiB; checkpoint placements: per block: 9, .*; per stage: 3", out, re.M), out
    fits, nothing = list(csv.DictReader(csv_path.open()))
    assert float(fits["exact_peak_ratio"]) <= 0.8 and float(fits["exact_max_rel_grad_error"]) < 1e-5
    assert float(fits["checkpoint_peak_ratio"]) <= 0.8 and fits["checkpoint_ladder"] in ("block", "stage")
    assert "no exact plan fits" in nothing["exact"] and nothing["checkpoint"].startswith("none fits (floor")
    assert "wrote" in stdout_of("budget.py", "--plot-exact", str(csv_path), "--plot", str(png)) and png.stat().st_size > 0
    baselines = stdout_of("budget.py", "--model", "resnet20", "--image-size", "32", "--batch", "16", "--steps", "1",
                          "--exact", "0.8", "--no-compile", "--baselines-only")
    assert re.search(r"^\| 0.80x \| not measured \|.*\| \d+ (block|stage) \|.*\| not measured \|", baselines, re.M), baselines


@pytest.mark.slow
def test_budget_benchmark_default_view_fits_each_budget(tmp_path: Path, stdout_of) -> None:
    """The default view: lessmem.fit at budgets between stock's peak and the floor (``--max-step-ratio``
    1: codes only), each chosen map trained a step and timed, one fit on a fresh cache, the CSV."""
    csv_path = tmp_path / "resnet20.csv"
    out = stdout_of("budget.py", "--model", "resnet20", "--image-size", "32", "--batch", "16", "--steps", "1",
                    "--budgets", "2", "--no-compile", "--max-step-ratio", "1", "--csv", str(csv_path))
    assert "choice at" in out and "checkpoint_peak_mib=" in out, out
    rows = list(csv.DictReader(csv_path.open()))
    assert len(rows) == 2 and all(float(r["lessmem_peak_mib"]) <= float(r["budget_mib"]) for r in rows)
    assert all(r["recomputed"] == "0" and r["fit_step_ratio"] == "" for r in rows)


@pytest.mark.slow
def test_context_benchmark_rows_for_lessmems_lossy_plans(tmp_path: Path, stdout_of) -> None:
    """lessmem's rows on a tiny Llama: fit's menu (its floor and the exact ladders measured) and, with
    --lossy-ratio, the menu's map at that fraction of stock's saved bytes, named so, reaching longer
    than HF stock within the budget."""
    pytest.importorskip("peft")
    csv_path = tmp_path / "context.csv"
    out = stdout_of("context.py", "--shape", "tiny", "--budgets", "4MiB", "--configs", "hf", "lessmem_lossy",
                    "--lossy-ratio", "0.5", "--lengths", "64", "128", "--probe-length", "32", "--time-length", "64",
                    "--repeats", "1", "--cap", "512", "--max-length", "512", "--measure", "profiler", "--csv", str(csv_path))
    stock, lossy = list(csv.DictReader(csv_path.open()))
    assert lossy["config"] == "lessmem_lossy_0.5x" and "lossy map at 0.5x saves" in out
    assert int(lossy["length"]) > int(stock["length"]) > 0 and int(lossy["peak_bytes"]) <= 4 * 2**20


@pytest.mark.slow
def test_context_benchmark_reads_a_fresh_process_peak_at_or_above_the_profiler(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step of the context table runs in a process of its own started with the mmap threshold
    fixed: its resident-set peak never reads below the profiler's (it adds the process's own
    non-tensor growth, a few MiB), with a plan handed over as a file."""
    pytest.importorskip("peft")
    import argparse

    import lessmem

    context = load_benchmark("context.py", monkeypatch)
    args = argparse.Namespace(shape="tiny", max_length=2048, seed=0, threads=1)
    plan = lessmem.CompressionPlan({"*lora_A*": "int8"}, saved_storage="int8")
    plan_file = str(plan.write(tmp_path / "plan.yaml"))
    for name, plans, file in (("hf", {}, None), ("lessmem_lossy", {"lessmem_lossy": plan}, plan_file)):
        fresh = context.fresh_peak(name, 2048, args, file)
        profiled = context.Setup(name, args, plans).profiled_peak(2048)
        assert profiled <= fresh <= profiled + 16 * 2**20, (name, fresh, profiled)


def test_context_benchmark_verifies_each_length_and_plots(tmp_path: Path, stdout_of) -> None:
    """The context table on a tiny Llama: every length it reports fits its budget by a real step, HF
    checkpointing with the chunked loss reaches longer than stock with the same gradients."""
    pytest.importorskip("peft")
    csv_path, png = tmp_path / "context.csv", tmp_path / "context.png"
    out = stdout_of("context.py", "--shape", "tiny", "--budgets", "4MiB", "--configs", "hf", "hf_checkpointing_chunked_loss",
                    "--lengths", "64", "128", "--probe-length", "32", "--time-length", "64", "--repeats", "1",
                    "--cap", "512", "--max-length", "512", "--measure", "profiler", "--csv", str(csv_path))
    stock, chunked = list(csv.DictReader(csv_path.open()))
    for row in (stock, chunked):
        assert 0 < int(row["peak_bytes"]) <= 4 * 2**20
    assert int(chunked["length"]) > int(stock["length"]) > 0 and float(chunked["grad_error"]) < 1e-2
    assert re.search(r"^\| hf_checkpointing_chunked_loss \| (≥ )?\d+ \(\d+ MiB\) \| 1\.000 at 64 \| [\d.e-]+ s, [\d.]+x HF \|", out, re.M), out
    assert "wrote" in stdout_of("context.py", "--plot-only", str(csv_path), "--plot", str(png)) and png.stat().st_size > 0
