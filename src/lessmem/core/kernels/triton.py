"""Fused Triton kernels for the 1-bit activation masks and the b-bit storages (the GPU path).

The torch reference (``ops.masked_activations.pack_bits`` / ``unpack_bits`` + a product) makes four to
five passes over memory per activation; these kernels make one each way:

- ``clamp_and_pack(x, lo, hi)``: y = clamp(x, lo, hi) and the packed pass mask, one read of x.
- ``masked_grad(grad, packed, channels_last)``: grad where the bit is set, else 0, one read of grad.
- ``quantize_groups`` / ``dequantize_groups``: the b-bit storages of ``storage`` (min, scale,
  noise, rounding and packing per group of 128 in one launch, and back), bit-identical to its
  torch reference and to the C++ kernels of ``kernels.cpu``; ``round_bf16``: its stochastic
  bfloat16, bit-identical too.

Bit layout is that of ``ops.masked_activations.pack_bits`` (element i of each group of 8, in memory
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
GROUP = 128  # elements per (min, scale) pair: storage.GROUP, which imports this module
GROUPS_PER_PROGRAM = 8  # 1024 elements per program


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

    @triton.jit
    def _hash32(v):
        # rounding.hash32 (lowbias32) on uint32: the products wrap as its masked ones do
        v ^= v >> 16
        v *= 0x7FEB352D
        v ^= v >> 15
        v *= 0x846CA68B
        return v ^ (v >> 16)

    @triton.jit
    def _to_bfloat16(v):
        # float32 -> bfloat16 rounded to nearest even in integers, as c10::BFloat16 does: the
        # interpreter the tests run under truncates a bfloat16 cast (the GPU rounds); NaN stays NaN
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(v != v, 0x7FC0, b)
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    # key: a Python int in [0, 2^32), passed as int32 or int64 by its size; cast to uint32 for
    # the wrapping sum (and never specialized: a key of 1 would become a constant)
    @triton.jit(do_not_specialize=["key"])
    def _quantize_kernel(x_ptr, codes_ptr, lo_ptr, scale_ptr, n, key,
                         BITS: tl.constexpr, STOCHASTIC: tl.constexpr, GROUP: tl.constexpr,
                         GROUPS: tl.constexpr):
        # a tile of GROUPS groups as (group, packed byte, code in the byte): the packing is a sum
        # over the last axis; every float operation is the reference's, in its order (no FMA)
        PER_BYTE: tl.constexpr = 8 // BITS
        LEVELS: tl.constexpr = (1 << BITS) - 1
        group = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        byte = tl.arange(0, GROUP // PER_BYTE)
        lane = tl.arange(0, PER_BYTE)
        index = group[:, None, None] * GROUP + byte[None, :, None] * PER_BYTE + lane[None, None, :]
        live = group * GROUP < n
        # index of the padded array: the last group's padding repeats x[n - 1]
        x = tl.load(x_ptr + tl.minimum(index, n - 1), mask=live[:, None, None], other=0.0).to(tl.float32)
        lo = tl.min(tl.min(x, axis=2), axis=1)
        hi = tl.max(tl.max(x, axis=2), axis=1)
        # div_rn: the plain float division of Triton is approximate on the GPU
        scale = tl.math.div_rn(tl.maximum(hi - lo, 1e-20), tl.full(lo.shape, LEVELS, tl.float32))
        q = tl.math.div_rn(x - lo[:, None, None], scale[:, None, None])
        if STOCHASTIC:
            noise = (_hash32(index.to(tl.uint32) + key.to(tl.uint32)) >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
            q = tl.floor(q + noise)
        else:
            # round half to even (0 <= q < 2^23: adding 2^23 leaves no fraction bits)
            q = (q + 8388608.0) - 8388608.0
        codes = tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.int32)
        packed = tl.sum(codes << (lane * BITS)[None, None, :], axis=2)
        tl.store(codes_ptr + group[:, None] * (GROUP // PER_BYTE) + byte[None, :], packed.to(tl.uint8),
                 mask=live[:, None])
        tl.store(lo_ptr + group, lo, mask=live)
        tl.store(scale_ptr + group, scale, mask=live)

    @triton.jit(do_not_specialize=["key"])
    def _round_bf16_kernel(x_ptr, out_ptr, n, key, BLOCK: tl.constexpr):
        # storage's stochastic bfloat16: the float32 bits plus 16 bits of noise, truncated
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        b = (x.to(tl.uint32, bitcast=True) + (_hash32(offs.to(tl.uint32) + key.to(tl.uint32)) >> 16)) >> 16
        b = tl.where(x != x, 0x7FC0, b)
        tl.store(out_ptr + offs, b.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=inside)

    @triton.jit
    def _dequantize_kernel(codes_ptr, lo_ptr, scale_ptr, out_ptr, n,
                           BITS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
        PER_BYTE: tl.constexpr = 8 // BITS
        group = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        byte = tl.arange(0, GROUP // PER_BYTE)
        lane = tl.arange(0, PER_BYTE)
        index = group[:, None, None] * GROUP + byte[None, :, None] * PER_BYTE + lane[None, None, :]
        live = group * GROUP < n
        packed = tl.load(codes_ptr + group[:, None] * (GROUP // PER_BYTE) + byte[None, :], mask=live[:, None],
                         other=0).to(tl.int32)
        codes = (packed[:, :, None] >> (lane * BITS)[None, None, :]) & ((1 << BITS) - 1)
        lo = tl.load(lo_ptr + group, mask=live, other=0.0)
        scale = tl.load(scale_ptr + group, mask=live, other=0.0)
        # two roundings, as the reference's mul_ then add_ (the launch turns off FMA contraction)
        values = codes.to(tl.float32) * scale[:, None, None] + lo[:, None, None]
        if out_ptr.dtype.element_ty == tl.bfloat16:
            out = _to_bfloat16(values)
        else:
            out = values.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + index, out, mask=index < n)


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


def masked_grad(grad: Tensor, bits: Tensor, channels_last: bool, out: Tensor | None = None) -> Tensor:
    """grad where the packed bit is set, else 0, in the activation's layout (bits are in its
    memory order)."""
    grad = grad.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    out = torch.empty_like(grad) if out is None or out.stride() != grad.stride() else out  # out may be grad
    n = grad.numel()
    grid = (triton.cdiv(bits.numel(), BLOCK_BYTES),)
    _masked_grad_kernel[grid](flat_memory_order(grad), bits, flat_memory_order(out), n, BLOCK=BLOCK_BYTES)
    return out


def quantize_groups(flat: Tensor, bits: int, key: int, stochastic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(codes packed 8 // bits per byte, float32 min and scale per group of 128) of a 1-d
    contiguous tensor; ``key`` seeds the rounding noise (to nearest when not ``stochastic``)."""
    n = flat.numel()
    groups = triton.cdiv(n, GROUP)
    codes = torch.empty(groups * GROUP * bits // 8, dtype=torch.uint8, device=flat.device)
    lo = torch.empty(groups, dtype=torch.float32, device=flat.device)
    scale = torch.empty_like(lo)
    grid = (triton.cdiv(groups, GROUPS_PER_PROGRAM),)
    _quantize_kernel[grid](flat, codes, lo, scale, n, key, BITS=bits, STOCHASTIC=stochastic, GROUP=GROUP,
                           GROUPS=GROUPS_PER_PROGRAM, enable_fp_fusion=False)
    return codes, lo, scale


def round_bf16(flat: Tensor, key: int) -> Tensor:
    """bfloat16 of a 1-d contiguous tensor, rounded stochastically with ``key``'s noise."""
    out = torch.empty(flat.numel(), dtype=torch.bfloat16, device=flat.device)
    grid = (triton.cdiv(flat.numel(), BLOCK_BYTES * 8),)
    _round_bf16_kernel[grid](flat, out, flat.numel(), key, BLOCK=BLOCK_BYTES * 8)
    return out


def dequantize_groups(codes: Tensor, lo: Tensor, scale: Tensor, bits: int, out: Tensor) -> Tensor:
    """The values ``quantize_groups`` stored, written into ``out`` (1-d, contiguous, of the
    original dtype and element count)."""
    grid = (triton.cdiv(lo.numel(), GROUPS_PER_PROGRAM),)
    _dequantize_kernel[grid](codes, lo, scale, out, out.numel(), BITS=bits, GROUP=GROUP,
                             GROUPS=GROUPS_PER_PROGRAM, enable_fp_fusion=False)
    return out
