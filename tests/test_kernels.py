"""The fused CPU kernels' build: one binary per instruction set, sources and flags; several
processes may build at once; the portable (scalar) build agrees with the torch reference; no
compiler means the torch reference with a warning; nothing on stderr once built."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lessmem
from lessmem.core.kernels import cpu, cpu_build

BUILD_LINE = "lessmem: building fused CPU kernels"


def run_python(script: str, timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout)


def require_kernels() -> Path:
    where = cpu.build_cpu_kernels()
    if where is None:
        pytest.skip("no C++ compiler here: the torch reference is used")
    return where


def test_binary_is_keyed_by_isa_sources_and_flags(tmp_path, monkeypatch) -> None:
    names = {isa: cpu_build.extension_name(isa) for isa in cpu_build.ISA_FLAGS}
    assert re.fullmatch(r"lessmem_cpu_avx2_[0-9a-f]{12}", names["avx2"])
    assert re.fullmatch(r"lessmem_cpu_scalar_[0-9a-f]{12}", names["scalar"])
    # explicit instruction sets, never the building CPU's own (-march=native)
    assert {"-mavx2", "-mfma"} <= set(cpu_build.ISA_FLAGS["avx2"])
    assert not any(f.startswith("-m") for f in cpu_build.ISA_FLAGS["scalar"])
    assert not any("native" in f for flags in cpu_build.ISA_FLAGS.values() for f in flags)
    edited = tmp_path / "csrc"
    shutil.copytree(cpu_build.SOURCE_DIR, edited)
    with (edited / "masks.cpp").open("a") as f:
        f.write("// edited\n")
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", edited)
    assert cpu_build.extension_name("avx2") != names["avx2"]


def test_the_sources_ship_as_package_data() -> None:
    """A wheel compiles the kernels from its own copy: pyproject's package data covers every file
    the build reads."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["lessmem"]
    package = Path(lessmem.__file__).parent
    for name in (*cpu_build.SOURCES, *cpu_build.HEADERS):
        path = (cpu_build.SOURCE_DIR / name).relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(path, p) for p in patterns), path


@pytest.mark.parametrize("machine, capability, forced, isa", [
    ("x86_64", "AVX2", "", "avx2"),
    ("x86_64", "AVX512", "", "avx2"),
    ("x86_64", "DEFAULT", "", "scalar"),
    ("aarch64", "DEFAULT", "", "scalar"),
    ("x86_64", "AVX2", "scalar", "scalar"),
    ("x86_64", "DEFAULT", "avx2", ValueError),
    ("x86_64", "AVX2", "sse9", ValueError),
])
def test_isa_follows_the_cpu_and_may_be_forced_down(machine, capability, forced, isa, monkeypatch) -> None:
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setenv(cpu_build.ISA_ENV, forced)
    if isa is ValueError:
        with pytest.raises(ValueError, match=cpu_build.ISA_ENV):
            cpu_build.cpu_isa()
    else:
        assert cpu_build.cpu_isa() == isa


@pytest.mark.slow
def test_stderr_is_clean_once_built() -> None:
    """No 'No CUDA runtime is found' log from torch.utils.cpp_extension, no build line, no
    warning: a compressed training step on CPU prints nothing on stderr."""
    require_kernels()
    proc = run_python("""
        import torch
        from torch import nn
        import lessmem
        from lessmem.core.kernels import cpu
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 4, 3))
        lessmem.compress(model, {"*": 2})
        model(torch.randn(2, 3, 16, 16)).sum().backward()
        assert cpu.enabled_for(torch.zeros(1))
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert proc.stderr == ""


def test_lessmem_kernels_prebuilds(capsys, monkeypatch) -> None:
    from lessmem.cli.kernels import main

    where = require_kernels()
    assert where.name == cpu_build.extension_name(cpu_build.cpu_isa())
    assert main() == 0
    assert str(where) in capsys.readouterr().out
    monkeypatch.setenv("LESSMEM_CPU_KERNELS", "0")
    assert main() == 1
    assert "unavailable" in capsys.readouterr().out


@pytest.mark.slow
def test_without_a_compiler_the_torch_reference_runs_with_a_warning(tmp_path) -> None:
    proc = run_python("""
        import torch, warnings
        from torch import nn
        import lessmem
        from lessmem.core.kernels import cpu
        torch.manual_seed(0)
        stock = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        x = torch.randn(2, 3, 16, 16)
        expected = stock(x)
        model = lessmem.compress(stock, {"*": 2})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(x)
        out.sum().backward()
        assert not cpu.enabled_for(x)
        assert torch.equal(out, expected)
        assert any("fused CPU kernels unavailable" in str(w.message) for w in caught)
        print("reference ok")
    """, timeout=300, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    assert proc.returncode == 0 and "reference ok" in proc.stdout, proc.stderr[-3000:]


CONCURRENT_USE = """
    import hashlib, torch
    from lessmem.core.kernels import cpu
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16, 24)
    assert cpu.enabled_for(x)
    y, bits = cpu.clamp_and_pack(x, 0.0, 6.0)
    grad = cpu.masked_grad(torch.randn_like(x), bits, False)
    pooled = cpu.pool_blocks(x, (2, 2))
    out, local = cpu.max_pool_compact(x, (3, 3), (2, 2), (1, 1), (1, 1), (8, 12))
    assert torch.equal(y, x.clamp(0.0, 6.0)) and torch.equal(out, torch.nn.functional.max_pool2d(x, 3, 2, 1))
    digest = hashlib.sha256()
    for t in (y, bits, grad, pooled, out, local):
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    print(cpu.build_cpu_kernels().name, digest.hexdigest())
"""


@pytest.mark.slow
def test_concurrent_first_use_builds_once(tmp_path) -> None:
    """Three processes start on a cold cache at once: one compiles while the others wait on its
    lock; all load the same binary and get the same results."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(CONCURRENT_USE)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(p.communicate(timeout=1200), p.returncode) for p in procs]
    for (_, err), code in results:
        assert code == 0, err[-3000:]
    lines = {out.strip() for (out, _), _ in results}
    assert len(lines) == 1, lines
    assert [d.name for d in tmp_path.iterdir()] == [lines.pop().split()[0]]
    assert any(BUILD_LINE in err for (_, err), _ in results)


@pytest.mark.slow
def test_scalar_build_matches_the_torch_reference() -> None:
    """The portable build (no AVX2 paths), forced on this CPU: its own binary, and the kernel
    tests (masks, block pooling, max-pooling, depthwise weight gradient, group quantization, BatchNorm's
    x_hat codes and the passes reading them) pass against it."""
    env = {cpu_build.ISA_ENV: "scalar"}
    proc = run_python("""
        from lessmem.core.kernels import cpu
        print(cpu.build_cpu_kernels().name)
    """, **env)
    assert proc.returncode == 0 and proc.stdout.startswith("lessmem_cpu_scalar_"), proc.stderr[-3000:]
    tests = Path(__file__).parent
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{tests / 'test_triton.py'}::test_fused_cpu_kernels_match_reference",
         f"{tests / 'test_triton.py'}::test_fused_cpu_block_pooling_equals_reference",
         f"{tests / 'test_compress.py'}::test_compact_maxpool_matches_stock_on_hard_inputs",
         f"{tests / 'test_compress.py'}::test_depthwise_weight_grad_kernel_equals_expanded_input",
         f"{tests / 'test_storage.py'}::test_fused_kernels_are_bit_identical_to_the_reference",
         f"{tests / 'test_fused_backward.py'}::test_fused_normalized_codes_are_the_torch_paths",
         f"{tests / 'test_fused_backward.py'}::test_fused_code_passes_of_the_batch_norm_backward_are_the_torch_ops",
         f"{tests / 'test_rebuilt_input.py'}::test_fused_rebuild_is_the_torch_ops"],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "skipped" not in proc.stdout


def test_threaded_kernels_equal_one_thread(monkeypatch) -> None:
    """The suite runs on one thread (conftest); the kernels split their loops over threads, and
    that split must not change a bit: masks, group codes (stochastic int4, bf16) and their decode."""
    from lessmem.core import storage as storage_module
    from lessmem.core.storage import pack_tensor, tensor_meta, unpack_tensor

    require_kernels()
    monkeypatch.setattr(storage_module, "next_key", lambda: 0x9E3779B9)
    torch.manual_seed(0)
    x = torch.randn(8, 64, 32, 32)

    def outputs() -> list[torch.Tensor]:
        _, bits = cpu.clamp_and_pack(x, 0.0, None)
        packed = [p for s in ("int4", "bf16") for p in pack_tensor(x, s)]
        decoded = [unpack_tensor(pack_tensor(x, s), s, tensor_meta(x)) for s in ("int4", "bf16")]
        return [bits, *packed, *decoded]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = outputs()
        torch.set_num_threads(2)
        threaded = outputs()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(single, threaded, strict=True))
