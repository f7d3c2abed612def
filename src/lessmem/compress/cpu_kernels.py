"""Fused C++ kernels for the 1-bit activation masks on CPU (built on first use).

The torch reference (``ops.pack_bits`` / ``ops.unpack_bits`` and a product) makes four to five
passes over memory per activation and direction; these make one, with ATen's thread pool:

- ``clamp_and_pack(x, lo, hi)``: y = clamp(x, lo, hi) and the packed pass mask.
- ``masked_grad(grad, bits)``: grad where the bit is set, else 0.

Same bit layout as ``ops.pack_bits`` (element i of each group of 8, in memory order, in bit i).
Compiled with ``torch.utils.cpp_extension.load_inline`` the first time a compressed model runs
on CPU (about a minute; cached in ``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``;
prebuild with ``python -m lessmem.compress.cpu_kernels``). Without a C++ compiler, or with
``LESSMEM_CPU_KERNELS=0``, the torch reference is used (one warning).
"""

from __future__ import annotations

import os
import threading
import warnings

import torch
from torch import Tensor

from ._layout import flat_memory_order

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>

// Work in chunks of CHUNK elements: a vectorizable elementwise loop into a byte buffer, then
// 8 flags -> 1 byte with one multiply per byte (and back), so every loop is branch-free.
constexpr int64_t CHUNK = 4096;
constexpr uint64_t GATHER = 0x0102040810204080ULL;  // byte i's bit 0 -> bit 56 + i
constexpr uint64_t SPREAD = 0x0101010101010101ULL;
constexpr uint64_t SELECT = 0x8040201008040201ULL;  // lane i keeps bit i

// y = clamp(x, lo, hi) (NaN stays NaN, like torch.clamp); bit i of byte b: y[8b+i] strictly
// inside (lo, hi). x, y: flat, memory order; y may alias x.
at::Tensor clamp_pack(at::Tensor x, at::Tensor y, double lo, double hi, bool has_hi) {
  const int64_t n = x.numel();
  const int64_t nbytes = (n + 7) / 8;
  auto bits = at::empty({nbytes}, x.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "clamp_pack", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    uint8_t* bp = bits.data_ptr<uint8_t>();
    const scalar_t lo_s = static_cast<scalar_t>(lo), hi_s = static_cast<scalar_t>(hi);
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      alignas(64) uint8_t flag[CHUNK];
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t start = c * CHUNK;
        const int64_t len = std::min(CHUNK, n - start);
        const scalar_t* xs = xp + start;
        scalar_t* ys = yp + start;
        if (has_hi) {
          for (int64_t i = 0; i < len; ++i) {
            scalar_t t = xs[i];
            t = t < lo_s ? lo_s : t;
            t = t > hi_s ? hi_s : t;
            ys[i] = t;
            flag[i] = (t > lo_s) & (t < hi_s);
          }
        } else {
          for (int64_t i = 0; i < len; ++i) {
            scalar_t t = xs[i];
            t = t < lo_s ? lo_s : t;
            ys[i] = t;
            flag[i] = t > lo_s;
          }
        }
        const int64_t full = (len + 7) / 8;
        std::memset(flag + len, 0, full * 8 - len);
        uint8_t* bs = bp + start / 8;
        for (int64_t b = 0; b < full; ++b) {
          uint64_t w;
          std::memcpy(&w, flag + 8 * b, 8);
          bs[b] = static_cast<uint8_t>((w * GATHER) >> 56);
        }
      }
    });
  });
  return bits;
}

// out[i] = bit i set ? grad[i] : 0; flat, memory order.
at::Tensor masked_grad(at::Tensor grad, at::Tensor bits, at::Tensor out) {
  const int64_t n = grad.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "masked_grad", [&] {
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const uint8_t* bp = bits.data_ptr<uint8_t>();
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      alignas(64) uint8_t flag[CHUNK];
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t start = c * CHUNK;
        const int64_t len = std::min(CHUNK, n - start);
        const uint8_t* bs = bp + start / 8;
        const int64_t full = (len + 7) / 8;
        for (int64_t b = 0; b < full; ++b) {
          const uint64_t w = (static_cast<uint64_t>(bs[b]) * SPREAD) & SELECT;
          std::memcpy(flag + 8 * b, &w, 8);
        }
        const scalar_t* gs = gp + start;
        scalar_t* os = op + start;
        const scalar_t zero = static_cast<scalar_t>(0);
        for (int64_t i = 0; i < len; ++i) {
          os[i] = flag[i] ? gs[i] : zero;
        }
      }
    });
  });
  return out;
}
"""

_lock = threading.Lock()
_module = None
_failed = False


def _load():
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            try:
                import logging

                from torch.utils.cpp_extension import load_inline

                # it warns that there is no CUDA runtime, which a CPU build does not need
                logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
                _module = load_inline(
                    name="lessmem_cpu_kernels_v2", cpp_sources=[_SOURCE],
                    functions=["clamp_pack", "masked_grad"],
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # no compiler, headers, ...: the torch reference still works
                _failed = True
                warnings.warn(f"lessmem: fused CPU mask kernels unavailable ({type(e).__name__}: "
                              f"{str(e)[:200]}); using the slower torch reference", stacklevel=3)
    return _module


def enabled_for(t: Tensor) -> bool:
    if os.environ.get("LESSMEM_CPU_KERNELS", "1") == "0" or t.device.type != "cpu":
        return False
    if torch.compiler.is_compiling() or t.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return False
    return _load() is not None


def clamp_and_pack(x: Tensor, lo: float, hi: float | None, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """(clamp(x, lo, hi), packed pass mask in x's memory order); x dense (contiguous or
    channels-last); written into x itself when ``inplace``."""
    y = x if inplace else torch.empty_like(x)
    bits = _module.clamp_pack(flat_memory_order(x), flat_memory_order(y), float(lo),
                              float(hi if hi is not None else 0.0), hi is not None)
    return y, bits


def masked_grad(grad: Tensor, bits: Tensor, channels_last: bool) -> Tensor:
    """grad where the packed bit is set, else 0, in the activation's layout."""
    grad = grad.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    out = torch.empty_like(grad)
    _module.masked_grad(flat_memory_order(grad), bits, flat_memory_order(out))
    return out


if __name__ == "__main__":
    x = torch.randn(4, 8, 5, 5)
    ok = enabled_for(x)
    print("lessmem fused CPU kernels:", "built and loaded" if ok else "unavailable")
    raise SystemExit(0 if ok else 1)
