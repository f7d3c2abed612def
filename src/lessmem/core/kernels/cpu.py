"""Fused C++ kernels on CPU for what lessmem adds around the stock ops (built on first use).

The torch reference makes several passes over memory where these make one, with ATen's thread
pool (AVX2 paths for float32 in the AVX2 build):

- ``clamp_and_pack(x, lo, hi)``: y = clamp(x, lo, hi) and the packed 1-bit pass mask.
- ``masked_grad(grad, bits)``: grad where the bit is set, else 0.
- ``pool_blocks(x, kernel)``: k×k block means (the saved copy of a conv input), summed in the
  reference's order, so the values are identical.
- ``max_pool_compact`` / ``max_pool_compact_backward``: max-pooling that records the argmax as
  a uint8 position in its window (not an int64 plane index), and its gradient scatter.
- ``depthwise_weight_grad``: a depthwise conv's weight gradient from its block means, each
  channel expanded in cache (the pooled grid saves depthwise convs nothing; a full-size expanded
  copy costs more than the gradient).
- ``quantize_groups`` / ``dequantize_groups``: the b-bit storages of ``storage`` (min, scale,
  noise, rounding and packing per group of 128 in one pass, and back), bit-identical to its
  torch reference; ``round_bf16``: its stochastic bfloat16, bit-identical too.
- ``normalize_quantize``: BatchNorm's codes of x_hat = (x - mean) * invstd made from x in one
  pass (no x_hat tensor); ``norm_codes_times_grad`` / ``norm_codes_input_grad``: the batch-norm
  gradient's elementwise passes read from those codes; ``rebuild_from_norm_codes``: a ``from_bn``
  conv's input from them and the ReLU mask. Each does the float operations of the torch ops it
  replaces in their order, so values are bit-identical to them.

Same bit layout as ``ops.masked_activations.pack_bits`` (element i of each group of 8, in memory order,
in bit i). The C++ lives in ``csrc/``; ``cpu_build`` compiles it the first time a compressed model
runs on CPU (about a minute, once per instruction set; prebuild with ``lessmem-kernels``).
Without a C++ compiler, or with ``LESSMEM_CPU_KERNELS=0``, the torch reference is used (one
warning when the build fails).
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

from lessmem.core.kernels.cpu_build import load_kernels
from lessmem.core.layout import flat_memory_order

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
                _module = load_kernels()
            except Exception as e:  # no compiler, headers, ...: the torch reference still works
                _failed = True
                warnings.warn(f"lessmem: fused CPU kernels unavailable ({type(e).__name__}: "
                              f"{str(e)[:200]}); using the slower torch reference", stacklevel=3)
    return _module


def _disabled() -> bool:
    return os.environ.get("LESSMEM_CPU_KERNELS", "1") == "0"


def enabled_for(t: Tensor) -> bool:
    if _disabled() or t.device.type != "cpu":
        return False
    if torch.compiler.is_compiling() or t.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return False
    return _load() is not None


def build_cpu_kernels() -> Path | None:
    """Build the fused CPU kernels now (else the first compressed step on CPU does) and return
    the directory of the binary for this CPU; None where they are disabled or cannot be built."""
    if _disabled() or _load() is None:
        return None
    return Path(_module.__file__).parent


def clamp_and_pack(x: Tensor, lo: float, hi: float | None, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """(clamp(x, lo, hi), packed pass mask in x's memory order); x dense (contiguous or
    channels-last); written into x itself when ``inplace``."""
    y = x if inplace else torch.empty_like(x)
    bits = _module.clamp_pack(flat_memory_order(x), flat_memory_order(y), float(lo),
                              float(hi if hi is not None else 0.0), hi is not None)
    return y, bits


def masked_grad(grad: Tensor, bits: Tensor, channels_last: bool, out: Tensor | None = None) -> Tensor:
    """grad where the packed bit is set, else 0, in the activation's layout."""
    grad = grad.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    out = torch.empty_like(grad) if out is None or out.stride() != grad.stride() else out  # out may be grad
    _module.masked_grad(flat_memory_order(grad), bits, flat_memory_order(out))
    return out


def pool_blocks(x: Tensor, kernel: tuple[int, int]) -> Tensor:
    """k×k block means of a dense 4-d x whose height and width are multiples of the block."""
    return _module.pool_blocks(x, kernel[0], kernel[1])


def depthwise_weight_grad(grad: Tensor, pooled: Tensor, weight_hw, stride, padding, dilation, kernel) -> Tensor:
    """Weight gradient (C, 1, kh, kw) of a depthwise conv from its output gradient and the k×k block
    means of its input; both contiguous NCHW, the blocks tiling the input."""
    return _module.depthwise_weight_grad(grad, pooled, *weight_hw, *stride, *padding, *dilation, *kernel)


def max_pool_compact(x: Tensor, kernel, stride, padding, dilation, out_hw) -> tuple[Tensor, Tensor]:
    """(max_pool2d(x), argmax position in each window as uint8); x contiguous 4-d."""
    return tuple(_module.max_pool_compact(x, *kernel, *stride, *padding, *dilation, *out_hw))


def max_pool_compact_backward(grad: Tensor, local: Tensor, kernel, stride, padding, dilation, in_hw) -> Tensor:
    return _module.max_pool_compact_backward(grad.contiguous(), local, *kernel, *stride, *padding, *dilation, *in_hw)


def quantize_groups(flat: Tensor, bits: int, key: int, stochastic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(codes packed 8 // bits per byte, float32 min and scale per group of 128) of a 1-d
    contiguous tensor; ``key`` seeds the rounding noise (to nearest when not ``stochastic``)."""
    return tuple(_module.quantize_groups(flat, bits, key, stochastic))


def round_bf16(flat: Tensor, key: int) -> Tensor:
    """bfloat16 of a 1-d contiguous tensor, rounded stochastically with ``key``'s noise."""
    return _module.round_bf16(flat, key)


def dequantize_groups(codes: Tensor, lo: Tensor, scale: Tensor, bits: int, out: Tensor) -> Tensor:
    """The values ``quantize_groups`` stored, written into ``out`` (1-d, contiguous, of the
    original dtype and element count)."""
    return _module.dequantize_groups(codes, lo, scale, bits, out)


def normalize_quantize(x: Tensor, mean: Tensor, invstd: Tensor, bits: int, key: int,
                       stochastic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``quantize_groups`` of (x - mean) * invstd (per channel, in mean's precision), made from a
    dense 4-d x in one pass: the codes packing that x_hat tensor would give."""
    return tuple(_module.normalize_quantize(x, mean, invstd, bits, key, stochastic))


def norm_codes_times_grad(packed, bits: int, grad: Tensor, out: Tensor) -> Tensor:
    """x_hat decoded from ``packed`` (codes, min, scale) times ``grad``, into ``out``; float32,
    both dense in the codes' memory order."""
    return _module.norm_codes_times_grad(*packed, bits, grad, out)


def norm_codes_input_grad(packed, bits: int, grad: Tensor, proj: Tensor, shift: Tensor, factor: Tensor,
                          out: Tensor) -> Tensor:
    """(grad - (x_hat * proj + shift)) * factor into ``out`` (which may be ``grad``), x_hat decoded
    from ``packed``, the others per channel; float32, dense in the codes' memory order."""
    return _module.norm_codes_input_grad(*packed, bits, grad, proj, shift, factor, out)


def rebuild_from_norm_codes(packed, bits: int, mask: Tensor, weight: Tensor, bias: Tensor, lo: float,
                            hi: float | None, out: Tensor) -> Tensor:
    """clamp(x_hat * weight + bias, lo, hi) as the pass mask ``mask`` (packed bits) says, into a
    float32 ``out`` dense in the codes' memory order: 0 off the mask for ReLU (no ``hi``), else
    the bound on the value's side of the range's middle."""
    return _module.rebuild_from_norm_codes(*packed, bits, mask, weight, bias, float(lo),
                                           float(hi if hi is not None else 0.0), hi is not None, out)
