"""The Triton kernels (GPU path), checked on CPU under Triton's interpreter: the mask kernels give
the same outputs, gradients and packed bits as the torch reference and stock autograd, the group
quantization the same codes, min, scale and decoded values as the storage reference."""

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
    from lessmem.core.ops.masked_activations import MaskedActivationFunction, pack_bits
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

GROUP_SCRIPT = textwrap.dedent("""
    import torch
    from lessmem.core import storage
    from lessmem.core.kernels import triton as triton_kernels
    from lessmem.core.rounding import next_key, set_rounding_seed
    assert storage._fused_group_kernels(torch.zeros(1)) is triton_kernels
    torch.manual_seed(0)
    # seed 9's first key is 0xC5F64A98: at least 2^31, so Triton passes it as int64 (the sum must wrap)
    ties = torch.cat([torch.tensor([0.0, 255.0]), torch.arange(126) + 0.5])  # 8 bits: q = k + 1/2
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        # 1155 and 540 elements: a partial last group, and not whole bytes of 1, 2 or 4-bit codes
        xs = [torch.randn(3, 5, 7, 11) * 3,
              torch.randn(2, 6, 5, 9).relu().contiguous(memory_format=torch.channels_last),
              ties, torch.full((3,), 2.5)]
        for storage_name, bits in storage.BITS.items():
            stochastic = storage.is_stochastic(storage_name)
            for x in xs:
                x = x.to(dtype)
                meta = storage.tensor_meta(x)
                set_rounding_seed(9)
                packed = storage.pack_tensor(x, storage_name)
                set_rounding_seed(9)
                key = next_key() if stochastic else 0
                ref = storage._quantize_reference(storage._flat(x, meta.channels_last), bits, key, stochastic)
                assert all(torch.equal(a, b) for a, b in zip(packed, ref)), (dtype, bits, x.shape)
                out = storage.unpack_tensor(packed, storage_name, meta)
                assert torch.equal(out, storage._dequantize_reference(*ref, bits, meta)), (dtype, bits, x.shape)
                assert out.dtype == dtype and out.stride() == x.stride()
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3.0e38, -1.0])
        for x in [*xs, specials] if dtype != torch.bfloat16 else []:  # a bfloat16 x is its own copy
            x = x.to(dtype)
            meta = storage.tensor_meta(x)
            set_rounding_seed(9)
            rounded = storage.pack_tensor(x, "bf16")[0]
            set_rounding_seed(9)
            ref = storage._round_bf16_reference(storage._flat(x, meta.channels_last), next_key())
            flat = storage._flat(rounded, meta.channels_last)
            assert torch.equal(flat.view(torch.int16), ref.view(torch.int16)), (dtype, x.shape)
            assert rounded.stride() == x.stride()
    print("triton group kernels ok")
""")


def _interpret(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "LESSMEM_TRITON": "1"}
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_triton_mask_kernels_match_reference() -> None:
    proc = _interpret(SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "triton kernels ok" in proc.stdout


@pytest.mark.slow
def test_triton_group_quantization_matches_reference() -> None:
    """int8/4/2/1 and int8_rn of float32, bfloat16, float16 and float64, contiguous and
    channels-last: the reference's codes, min and scale (stochastic-rounding noise included), and
    its decoded values; stochastic bf16: the reference's bits (NaN, infinities, zeros too)."""
    proc = _interpret(GROUP_SCRIPT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "triton group kernels ok" in proc.stdout


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

    from lessmem.core.kernels import cpu as cpu_kernels
    from lessmem.core.ops.masked_activations import MaskedActivationFunction, pack_bits

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

    from lessmem.core.kernels import cpu as cpu_kernels
    from lessmem.core.ops.pooling import pool_blocks

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
