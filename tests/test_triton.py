"""The Triton mask kernels (GPU path), checked on CPU under Triton's interpreter: the same
outputs, gradients and packed bits as the torch reference and stock autograd."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from lessmem.core.kernels import triton as triton_kernels
    from lessmem.core.functions.masks import MaskedActivationFunction, pack_bits
    assert triton_kernels.enabled_for(torch.zeros(1))
    torch.manual_seed(0)
    for cl in (False, True):
        for hi in (None, 6.0):
            for inplace in (False, True):
                x = torch.randn(2, 5, 7, 3) * 4
                if cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                x.requires_grad_()
                y = MaskedActivationFunction.apply(x * 1, 0.0, hi, inplace)
                g = torch.randn_like(y)
                gx, = torch.autograd.grad(y, x, g)
                ref = torch.clamp(x, 0.0, hi) if hi else torch.relu(x)
                ref_gx, = torch.autograd.grad(ref, x, g)
                assert torch.equal(y, ref) and torch.equal(gx, ref_gx), (cl, hi, inplace)
                assert y.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
            # packed bits are those of the reference packer (memory order)
            x = torch.randn(3, 4, 5, 6)
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            _, bits = triton_kernels.clamp_and_pack(x, 0.0, hi)
            y = torch.clamp(x, 0.0, hi) if hi else torch.relu(x)
            passed = (y > 0) if hi is None else (y > 0) & (y < hi)
            ref_bits = pack_bits(passed.permute(0, 2, 3, 1) if cl else passed)
            assert torch.equal(bits, ref_bits), (cl, hi)
    print("triton kernels ok")
""")


@pytest.mark.slow
def test_triton_mask_kernels_match_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "LESSMEM_TRITON": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "triton kernels ok" in proc.stdout


def test_cpu_tensors_use_the_torch_reference_by_default() -> None:
    import torch

    from lessmem.core.kernels import triton as triton_kernels

    if os.environ.get("LESSMEM_TRITON") == "1":
        pytest.skip("LESSMEM_TRITON=1 forces the kernels")
    assert not triton_kernels.enabled_for(torch.zeros(1))


def test_fused_cpu_kernels_match_reference(monkeypatch) -> None:
    """The C++ mask kernels (default on CPU) against the torch reference: same outputs, bits,
    gradients, contiguous and channels-last, ReLU and Hardtanh, in place or not."""
    import torch

    from lessmem.core.functions.masks import MaskedActivationFunction, pack_bits
    from lessmem.core.kernels import cpu as cpu_kernels

    if not cpu_kernels.enabled_for(torch.zeros(1)):
        pytest.skip("no C++ compiler here: the torch reference is used")
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for cl in (False, True):
            for hi in (None, 6.0):
                x = (torch.randn(3, 5, 7, 9) * 4).to(dtype)
                if cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                _, bits = cpu_kernels.clamp_and_pack(x, 0.0, hi)
                y = torch.clamp(x, 0.0, hi) if hi else torch.relu(x)
                passed = (y > 0) if hi is None else (y > 0) & (y < hi)
                assert torch.equal(bits, pack_bits(passed.permute(0, 2, 3, 1) if cl else passed))
                for inplace in (False, True):
                    xx = x.clone().requires_grad_()
                    out = MaskedActivationFunction.apply(xx * 1, 0.0, hi, inplace)
                    g = torch.randn_like(out)
                    gx, = torch.autograd.grad(out, xx, g)
                    ref_gx, = torch.autograd.grad(torch.clamp(xx, 0.0, hi) if hi else torch.relu(xx), xx, g)
                    assert torch.equal(out, y) and torch.equal(gx, ref_gx), (dtype, cl, hi, inplace)


def test_fused_cpu_block_pooling_equals_reference(monkeypatch) -> None:
    """The C++ block pooling sums in the torch reference's order: identical values (fp32/fp64),
    contiguous and channels-last, square and oblong blocks, same layout out."""
    import torch

    from lessmem.core.functions.pooling import pool_blocks
    from lessmem.core.kernels import cpu as cpu_kernels

    if not cpu_kernels.enabled_for(torch.zeros(1)):
        pytest.skip("no C++ compiler here: the torch reference is used")
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for cl in (False, True):
            for kernel in ((2, 2), (4, 4), (3, 2), (2, 4)):
                x = torch.randn(3, 5, 12, 40).to(dtype)  # rows of 40: vector body and scalar tail
                if cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                fused = cpu_kernels.pool_blocks(x, kernel)
                with monkeypatch.context() as m:
                    m.setenv("LESSMEM_CPU_KERNELS", "0")
                    ref = pool_blocks(x, kernel)
                assert fused.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
                if dtype == torch.bfloat16:  # the kernel sums in float, the reference in bf16
                    torch.testing.assert_close(fused, ref, rtol=0.02, atol=0.02)
                else:
                    assert torch.equal(fused, ref), (dtype, cl, kernel)
