"""Fused Triton kernels for the 1-bit activation masks (the GPU path).

The torch reference (``functions.masks.pack_bits`` / ``unpack_bits`` + a product) makes four to
five passes over memory per activation; these kernels make one each way:

- ``clamp_and_pack(x, lo, hi)``: y = clamp(x, lo, hi) and the packed pass mask, one read of x.
- ``masked_grad(grad, packed, channels_last)``: grad where the bit is set, else 0, one read of grad.

Bit layout is that of ``functions.masks.pack_bits`` (element i of each group of 8, in memory
order, in bit i), so packed masks from either path are interchangeable. Used for CUDA tensors
when Triton is importable (``LESSMEM_TRITON=0`` turns it off); ``LESSMEM_TRITON=1`` also routes
CPU tensors here, which only works under ``TRITON_INTERPRET=1`` (how the tests check the kernels
without a GPU).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from lessmem.core.layout import flat_memory_order

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton ships with torch on Linux
    triton = None

BLOCK_BYTES = 256  # packed bytes per program: 2048 elements


def enabled_for(t: Tensor) -> bool:
    flag = os.environ.get("LESSMEM_TRITON", "auto")
    if triton is None or flag == "0" or torch.compiler.is_compiling():
        return False
    if flag == "1":
        return True
    return t.is_cuda


if triton is not None:

    @triton.jit
    def _clamp_pack_kernel(x_ptr, y_ptr, bits_ptr, n, lo, hi, HAS_HI: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        byte = pid * BLOCK + tl.arange(0, BLOCK)
        lane = tl.arange(0, 8)
        offs = byte[:, None] * 8 + lane[None, :]
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0)
        y = tl.maximum(x, lo)
        passed = y > lo
        if HAS_HI:
            y = tl.minimum(y, hi)
            passed = passed & (y < hi)
        tl.store(y_ptr + offs, y, mask=inside)
        weights = (1 << lane)[None, :]
        packed = tl.sum(tl.where(passed & inside, weights, 0), axis=1)
        tl.store(bits_ptr + byte, packed.to(tl.uint8), mask=byte * 8 < n)

    @triton.jit
    def _masked_grad_kernel(g_ptr, bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        byte = pid * BLOCK + tl.arange(0, BLOCK)
        lane = tl.arange(0, 8)
        offs = byte[:, None] * 8 + lane[None, :]
        inside = offs < n
        bits = tl.load(bits_ptr + byte, mask=byte * 8 < n, other=0).to(tl.int32)
        on = ((bits[:, None] >> lane[None, :]) & 1) != 0
        g = tl.load(g_ptr + offs, mask=inside, other=0.0)
        tl.store(out_ptr + offs, tl.where(on, g, 0.0), mask=inside)


def clamp_and_pack(x: Tensor, lo: float, hi: float | None, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """(clamp(x, lo, hi), packed pass mask in x's memory order); x dense (contiguous or
    channels-last); written into x itself when ``inplace``."""
    y = x if inplace else torch.empty_like(x)
    n = x.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    grid = (triton.cdiv(bits.numel(), BLOCK_BYTES),)
    _clamp_pack_kernel[grid](flat_memory_order(x), flat_memory_order(y), bits, n, float(lo),
                             float(hi if hi is not None else 0.0), HAS_HI=hi is not None, BLOCK=BLOCK_BYTES)
    return y, bits


def masked_grad(grad: Tensor, bits: Tensor, channels_last: bool) -> Tensor:
    """grad where the packed bit is set, else 0, in the activation's layout (bits are in its
    memory order)."""
    grad = grad.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    out = torch.empty_like(grad)
    n = grad.numel()
    grid = (triton.cdiv(bits.numel(), BLOCK_BYTES),)
    _masked_grad_kernel[grid](flat_memory_order(grad), bits, flat_memory_order(out), n, BLOCK=BLOCK_BYTES)
    return out
