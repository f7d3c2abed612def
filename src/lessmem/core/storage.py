"""How a saved tensor is stored: native dtype, bfloat16, or b-bit codes (b = 8, 4, 2, 1) with one
(min, scale) pair per group of ``GROUP`` consecutive elements.

Groups run over the tensor's memory order (for a channels-last image, over channels at a pixel;
for a contiguous one, along a row of a channel plane; for tokens, along the features of a token):
``GROUP`` consecutive elements, the last group padded with the last element. Each group keeps its
min and scale as float32 (8 bytes per 128 elements, 0.5 bit per element). Codes below 8 bits are
packed 8 // b to a byte, the first code in the low bits.

Every lossy storage of the menu rounds stochastically and unbiased (E[decoded] = x), with the
seeded counter noise of ``rounding``: b-bit codes add uniform noise in [0, 1) before the floor;
``bf16`` adds 16 random bits below a float32's top 16 and truncates (the float32 of a float64 is
rounded to nearest first). Biased rounding costs accuracy (issue 31: int8 rounded to nearest
+5.0% val_ppl on a tiny Llama, int4 stochastic +1.1%), so round-to-nearest is only there by name:

=========  =====================================  ==============
storage    keeps                                  rounding
=========  =====================================  ==============
native     the tensor itself                      exact
bf16       bfloat16 copy (16 bits per element)    stochastic
int8..1    b-bit codes + min, scale per group     stochastic
bf16_rn    bfloat16 copy                          to nearest even
int8_rn    8-bit codes + min, scale per group     to nearest even
=========  =====================================  ==============

The fused kernels (C++ on CPU, ``kernels.cpu``; Triton on CUDA, ``kernels.triton``) quantize and
decode in one pass each, with the same bits as the torch reference here.

Anything but ``"native"`` is lossy.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.kernels import triton as triton_kernels
from lessmem.core.layout import flat_memory_order
from lessmem.core.rounding import MASK32, next_key, noise_hashes, uniform_noise

Storage = Literal["native", "bf16", "int8", "int4", "int2", "int1", "bf16_rn", "int8_rn"]
# The menu: exact, or unbiased at every width.
UNBIASED_STORAGES: tuple[str, ...] = ("native", "bf16", "int8", "int4", "int2", "int1")
ROUND_TO_NEAREST: tuple[str, ...] = ("bf16_rn", "int8_rn")
STORAGES: tuple[str, ...] = UNBIASED_STORAGES + ROUND_TO_NEAREST
BITS: dict[str, int] = {"int8": 8, "int4": 4, "int2": 2, "int1": 1, "int8_rn": 8}
BFLOAT16: tuple[str, ...] = ("bf16", "bf16_rn")  # the storages that keep a bfloat16 copy
GROUP = 128
RANGE_BYTES = 8  # float32 min and scale per group
FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # what the kernels take


class TensorMeta(NamedTuple):
    """What unpacking needs besides the packed tensors."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    channels_last: bool


def check_storage(storage: str) -> Storage:
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r}; choose one of {', '.join(STORAGES)}")
    return storage  # type: ignore[return-value]


def is_stochastic(storage: str) -> bool:
    return check_storage(storage) not in ("native", *ROUND_TO_NEAREST)


def describe_storage(storage: str) -> str:
    """One line on what ``storage`` keeps (``lessmem-info`` lists the menu with these)."""
    if storage == "native":
        return "the tensor itself (exact)"
    rounding = ("stochastic unbiased rounding, seeded by the run" if is_stochastic(storage)
                else "rounded to nearest (biased; the unbiased default drops the _rn)")
    if storage in BFLOAT16:
        return f"a bfloat16 copy (16 bits per element), {rounding}"
    bits = BITS[storage]
    return (f"{bits}-bit codes, min and scale per {GROUP} elements in memory order "
            f"({bits + RANGE_BYTES * 8 / GROUP:g} bits per element), {rounding}")


def stored_bytes(numel: int, storage: str, element_size: int) -> int:
    """Bytes ``pack_tensor`` keeps for a tensor of ``numel`` elements of ``element_size`` bytes."""
    if storage == "native":
        return numel * element_size
    if storage in BFLOAT16:
        return numel * 2
    groups = -(-numel // GROUP)
    return groups * GROUP * BITS[storage] // 8 + groups * RANGE_BYTES


def tensor_meta(x: Tensor) -> TensorMeta:
    channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return TensorMeta(tuple(x.shape), x.dtype, channels_last)


def _flat(x: Tensor, channels_last: bool) -> Tensor:
    """x's elements in memory order (a view when x is dense in its layout)."""
    return (x.permute(0, 2, 3, 1) if channels_last else x).reshape(-1)


def pack_tensor(x: Tensor, storage: Storage) -> tuple[Tensor, ...]:
    """The tensors that stand for ``x`` in ``storage``: (x,), (bf16 copy,), or (codes, min, scale)."""
    if storage == "native":
        return (x,)
    if storage == "bf16_rn" or (storage == "bf16" and x.dtype == torch.bfloat16):  # x is its own copy
        return (x.to(torch.bfloat16),)
    if torch.compiler.is_compiling():
        # Opaque ops under torch.compile: the noise key is drawn when the graph runs (traced, it
        # would be one constant), and what they return is fresh (a view of an intermediate saved
        # inside an autograd.Function fails to trace).
        if storage == "bf16":
            return (torch.ops.lessmem.round_bf16(x),)
        return tuple(torch.ops.lessmem.quantize(x, BITS[storage], is_stochastic(storage)))
    if storage == "bf16":
        return (_round_bf16(x),)
    return _quantize_groups(x.detach(), BITS[storage], is_stochastic(storage))  # no custom-op dispatch: ~25 us a call


@torch.library.custom_op("lessmem::round_bf16", mutates_args=())
def _round_bf16(x: Tensor) -> Tensor:
    """Stochastic bf16 storage of x (not bfloat16 itself), in x's layout (channels-last or contiguous)."""
    meta = tensor_meta(x)
    flat = _flat(x, meta.channels_last)
    key = next_key()
    fused = _fused_group_kernels(flat) if flat.dtype in FUSED_DTYPES else None
    rounded = fused.round_bf16(flat.contiguous(), key) if fused is not None else _round_bf16_reference(flat, key)
    return _unflat(rounded, meta)


@_round_bf16.register_fake
def _(x):
    layout = torch.channels_last if tensor_meta(x).channels_last else torch.contiguous_format
    return x.new_empty(x.shape, dtype=torch.bfloat16).contiguous(memory_format=layout)


@torch.library.custom_op("lessmem::quantize", mutates_args=())
def _quantize(x: Tensor, bits: int, stochastic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``_quantize_groups`` as an op the compiler keeps opaque."""
    return _quantize_groups(x, bits, stochastic)


def pack_codes(x: Tensor, storage: Storage, key: int) -> tuple[Tensor, Tensor, Tensor]:
    """``pack_tensor`` in an integer storage with the noise ``key`` given (eager only): a slice of a
    larger tensor, at an offset of o elements (o a multiple of ``GROUP``) and packed with that
    tensor's key + o, gets the codes packing the whole tensor would give it."""
    return _quantize_groups(x.detach(), BITS[storage], is_stochastic(storage), key & MASK32)


def _quantize_groups(x: Tensor, bits: int, stochastic: bool, key: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(codes, min, scale) of x's ``bits``-bit storage, rounded stochastically or to nearest
    (``key``: the noise key; None draws the next one)."""
    flat = _flat(x, tensor_meta(x).channels_last)
    if key is None:
        key = next_key() if stochastic else 0
    fused = _fused_group_kernels(flat) if flat.dtype in FUSED_DTYPES else None
    if fused is not None:  # one fused pass, the reference's bits
        return fused.quantize_groups(flat.contiguous(), bits, key, stochastic)
    return _quantize_reference(flat, bits, key, stochastic)


@_quantize.register_fake
def _(x, bits, stochastic):
    groups = -(-x.numel() // GROUP)
    return (x.new_empty((groups * GROUP * bits // 8,), dtype=torch.uint8),
            x.new_empty((groups,), dtype=torch.float32), x.new_empty((groups,), dtype=torch.float32))


def _round_bf16_reference(flat: Tensor, key: int) -> Tensor:
    """bfloat16 of ``flat``, rounded stochastically: element i's float32 bits plus the top 16 bits
    of its noise hash, truncated to the top 16 (a carry rounds the magnitude up with probability
    the dropped fraction, as linear within a binade); NaN becomes the quiet NaN 0x7FC0."""
    f = flat.to(torch.float32)
    bits = f.view(torch.int32).to(torch.int64) & MASK32
    top = (bits + (noise_hashes(f.numel(), key, f.device) >> 16)) >> 16
    top = torch.where(f.isnan(), 0x7FC0, top)
    return (top - ((top >> 15) << 16)).to(torch.int16).view(torch.bfloat16)  # as signed 16-bit words


def _unflat(flat: Tensor, meta: TensorMeta) -> Tensor:
    """A tensor of ``meta``'s shape (and layout) whose memory order holds ``flat``."""
    if meta.channels_last:
        n, c, h, w = meta.shape
        return flat.view(n, h, w, c).permute(0, 3, 1, 2)
    return flat.view(meta.shape)


def _fused_group_kernels(t: Tensor):
    """The fused group kernels for ``t`` (Triton on CUDA, C++ on CPU), or None for the reference."""
    return next((k for k in (triton_kernels, cpu_kernels) if k.enabled_for(t)), None)


def _quantize_reference(flat: Tensor, bits: int, key: int, stochastic: bool) -> tuple[Tensor, Tensor, Tensor]:
    pad = -flat.numel() % GROUP
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    groups = flat.view(-1, GROUP).float()
    lo = groups.amin(dim=1, keepdim=True)
    levels = (1 << bits) - 1
    # Divided by a tensor: CUDA divides by a Python number as a product with its float reciprocal
    # (an ulp off in most groups), and the scale is to be the same on every device and kernel.
    scale = (groups.amax(dim=1, keepdim=True) - lo).clamp_min_(1e-20).div_(lo.new_full((1, 1), levels))
    q = (groups - lo).div_(scale)
    if stochastic:
        q.add_(uniform_noise(q.numel(), key, q.device).view_as(q)).floor_()
    else:
        q.round_()
    codes = q.clamp_(0, levels).to(torch.uint8)
    if bits < 8:
        per_byte = 8 // bits
        codes = codes.view(-1, per_byte)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        codes = (codes << shifts).sum(dim=1, dtype=torch.uint8)
    return codes.reshape(-1), lo.reshape(-1), scale.reshape(-1)


def unpack_tensor(packed: tuple[Tensor, ...] | list[Tensor], storage: Storage, meta: TensorMeta) -> Tensor:
    """The tensor ``pack_tensor`` stored, decoded to ``meta``'s shape, dtype and layout."""
    if storage == "native":
        return packed[0]
    if storage in BFLOAT16:
        return packed[0].to(meta.dtype)
    codes, lo, scale = packed
    bits = BITS[storage]
    fused = _fused_group_kernels(lo) if meta.dtype in FUSED_DTYPES else None
    if fused is not None:
        layout = torch.channels_last if meta.channels_last else torch.contiguous_format
        out = torch.empty(meta.shape, dtype=meta.dtype, device=lo.device, memory_format=layout)
        fused.dequantize_groups(codes, lo, scale, bits, flat_memory_order(out))
        return out
    return _dequantize_reference(codes, lo, scale, bits, meta)


def _dequantize_reference(codes: Tensor, lo: Tensor, scale: Tensor, bits: int, meta: TensorMeta) -> Tensor:
    if bits < 8:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        codes = (codes.view(-1, 1) >> shifts) & ((1 << bits) - 1)
    values = codes.reshape(-1, GROUP).float().mul_(scale.view(-1, 1)).add_(lo.view(-1, 1))
    numel = 1
    for s in meta.shape:
        numel *= s
    return _unflat(values.reshape(-1)[:numel].to(meta.dtype), meta)


# Decode a batch slice of a packed tensor, so backward can walk a packed activation a few samples
# at a time instead of decoding a full-size copy.
def sliceable(meta: TensorMeta, storage: Storage) -> bool:
    """Whether samples start on a group boundary (groups run over memory order, sample-major in
    both NCHW and NHWC), so a slice of samples is a slice of the packed tensors."""
    per_sample = 1
    for s in meta.shape[1:]:
        per_sample *= s
    return storage == "native" or storage in BFLOAT16 or (len(meta.shape) > 1 and per_sample % GROUP == 0)


def samples_of(packed: tuple[Tensor, ...] | list[Tensor], storage: Storage, meta: TensorMeta,
               start: int, stop: int) -> tuple[tuple[Tensor, ...], TensorMeta]:
    """The packed tensors of samples ``start:stop`` (views; ``sliceable`` must hold) and their meta."""
    part_meta = meta._replace(shape=(stop - start, *meta.shape[1:]))
    if storage == "native" or storage in BFLOAT16:
        return (packed[0][start:stop],), part_meta
    codes, lo, scale = packed
    groups = lo.numel() // meta.shape[0]
    per_byte = 8 // BITS[storage]
    g0, g1 = start * groups, stop * groups
    return (codes[g0 * GROUP // per_byte: g1 * GROUP // per_byte], lo[g0:g1], scale[g0:g1]), part_meta


def unpack_samples(packed: tuple[Tensor, ...] | list[Tensor], storage: Storage, meta: TensorMeta,
                   start: int, stop: int) -> Tensor:
    """Samples ``start:stop`` of the tensor ``packed`` stands for (``sliceable`` must hold)."""
    part, part_meta = samples_of(packed, storage, meta, start, stop)
    return unpack_tensor(part, storage, part_meta)
