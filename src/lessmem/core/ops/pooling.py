"""Block and token means: the pooled copies that stand in for a layer's input in backward, how the
pooled conv and linear Functions save and read them back, and the window sums the pooled-grid
weight gradient is built from."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.layout import format_of, is_channels_last, is_dense
from lessmem.core.storage import Storage, TensorMeta, pack_tensor, tensor_meta, unpack_tensor

Pair = tuple[int, int]


def pool_blocks(x: Tensor, kernel: Pair) -> Tensor:
    """k×k block means. ``ceil_mode`` keeps partial edge blocks, averaged over their true size."""
    if kernel == (1, 1):
        return x  # kernel 1: the input itself (a quantized storage then packs it whole)
    h, w = x.shape[-2:]
    if x.dim() == 4 and h % kernel[0] == 0 and w % kernel[1] == 0:
        if is_dense(x) and cpu_kernels.enabled_for(x):
            return cpu_kernels.pool_blocks(x, kernel)  # same values, one pass
        # Blocks tile the input: sums of strided views (any memory layout) beat avg_pool2d on CPU.
        return sum_strided(sum_strided(x, kernel[0], 2), kernel[1], 3).mul_(1.0 / (kernel[0] * kernel[1]))
    return F.avg_pool2d(x, kernel, stride=kernel, ceil_mode=True)


def sum_strided(x: Tensor, m: int, dim: int) -> Tensor:
    """Sums of ``m`` consecutive entries along ``dim`` (its size a multiple of m)."""
    if m == 1:
        return x
    parts = [x[(slice(None),) * dim + (slice(j, None, m),)] for j in range(m)]
    out = parts[0] + parts[1]
    for part in parts[2:]:
        out += part
    return out


def expand_blocks(pooled: Tensor, kernel: Pair, size: Pair) -> Tensor:
    """Inverse layout of ``pool_blocks``: repeat each mean over its block, cropped to ``size``.
    Keeps a channels-last layout channels-last (mixed layouts slow the conv backward)."""
    n, c, h, w = pooled.shape
    kh, kw = kernel
    if is_channels_last(pooled):
        nhwc = pooled.permute(0, 2, 3, 1)
        full = nhwc[:, :, None, :, None, :].expand(n, h, kh, w, kw, c).reshape(n, h * kh, w * kw, c)
        return full[:, : size[0], : size[1]].permute(0, 3, 1, 2)
    full = pooled[:, :, :, None, :, None].expand(n, c, h, kh, w, kw).reshape(n, c, h * kh, w * kw)
    return full[:, :, : size[0], : size[1]]


def pool_tokens(x: Tensor, k: int) -> Tensor:
    """Means of groups of ``k`` consecutive tokens along dim -2 (partial last group kept)."""
    if k == 1:
        return x
    return F.avg_pool1d(x.transpose(-1, -2).reshape(-1, 1, x.shape[-2]), k, k, ceil_mode=True).view(
        *x.shape[:-2], x.shape[-1], -1
    ).transpose(-1, -2)


def expand_tokens(pooled: Tensor, k: int, tokens: int) -> Tensor:
    if k == 1:
        return pooled  # repeat_interleave would copy it
    return pooled.repeat_interleave(k, dim=-2)[..., :tokens, :]


# Pooled copies of one input shared by several layers (ResNet's conv1 and downsample read the block
# input; q / k / v and gate / up projections read the same hidden states): the second layer reuses
# the first one's tensor, so it is stored once. The copies are kept on the tensor whose memory they
# stand for (a view's base) under the view's geometry, so another view of the same memory, laid out
# alike, finds them too: a layer that packed its output (``offer_pooled_tokens``) hands its code to
# the next layer through the views between them.
_CACHE_ATTR = "_lessmem_pooled"


Packed = tuple[tuple[Tensor, ...], TensorMeta]


def _packed(pooled: Tensor, storage: Storage) -> Packed:
    return pack_tensor(pooled, storage), tensor_meta(pooled)


def pooled_once(x: Tensor, kernel: Pair, storage: Storage) -> Packed:
    """``pool_blocks`` of ``x`` packed in ``storage`` (and how to unpack it), once per tensor version."""
    return _once(x, ("blocks", kernel, storage), lambda: _packed(pool_blocks(x.detach(), kernel), storage))


def pooled_tokens_once(x: Tensor, k: int, storage: Storage) -> Packed:
    """``pool_tokens`` of ``x`` packed in ``storage`` (and how to unpack it), once per tensor version."""
    return _once(x, ("tokens", k, storage), lambda: _packed(pool_tokens(x.detach(), k), storage))


def offer_pooled_tokens(x: Tensor, k: int, storage: Storage, packed: Packed) -> None:
    """Make ``packed`` what ``pooled_tokens_once(x, k, storage)`` returns for ``x`` (or a view of its
    memory laid out as ``x``) until ``x`` changes: a layer that already packed it thus shares its code."""
    if not torch.compiler.is_compiling():
        _cache(x)[_key(x, ("tokens", k, storage))] = packed


def _once(x: Tensor, kind: tuple, make: Callable[[], Packed]) -> Packed:
    if torch.compiler.is_compiling():  # the compiler de-duplicates; tensor attributes would break graphs
        return make()
    cache, key = _cache(x), _key(x, kind)
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _key(x: Tensor, kind: tuple) -> tuple:
    return (*kind, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)


def _cache(x: Tensor) -> dict:
    """The pooled copies kept for the memory of ``x`` at its current version (a new version drops them)."""
    holder = x if x._base is None else x._base
    version, cache = getattr(holder, _CACHE_ATTR, (None, None))
    if version != x._version:
        cache = {}
        setattr(holder, _CACHE_ATTR, (x._version, cache))
    return cache


# Below this many elements a padded copy (one op) is cheaper than edge sums (a few small ops each);
# above it the fresh padded buffer's page faults and fill cost more (CPU, resnet18 / resnet20).
PAD_COPY_MAX_ELEMENTS = 2**20


def sum_windows(x: Tensor, m: int, dim: int, front: int = 0, back: int = 0) -> Tensor:
    """Sums of every ``m`` consecutive entries along ``dim`` of x zero-padded by ``front`` and
    ``back`` entries (stride 1: size + front + back - m + 1 of them). Large inputs never
    materialize the padding (a padded copy costs an allocation, a fill and a copy, and fresh
    large buffers cost page faults): the edge sums are taken from the entries inside x. Small
    ones are padded first, which is fewer ops."""
    if (front or back) and x.numel() < PAD_COPY_MAX_ELEMENTS:  # small: fewer ops beat fewer buffers
        x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [front, back])
        front = back = 0
    size = x.shape[dim]
    count = size + front + back - m + 1
    if m == 1 and not (front or back):
        return x
    out_shape = list(x.shape)
    out_shape[dim] = count
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device, memory_format=format_of(x))
    # sums r with all m terms inside x: r in [front, size + front - m + 1)
    lo, hi = min(front, count), max(min(front, count), min(size + front - m + 1, count))
    if hi > lo:
        inner = out.narrow(dim, lo, hi - lo)
        if m == 1:
            inner.copy_(x.narrow(dim, lo - front, hi - lo))
        else:
            torch.add(x.narrow(dim, lo - front, hi - lo), x.narrow(dim, lo - front + 1, hi - lo), out=inner)
            for j in range(2, m):
                inner += x.narrow(dim, lo - front + j, hi - lo)
    for r in [*range(lo), *range(hi, count)]:  # edge sums: the terms that fall inside x
        first, last = max(0, r - front), min(size, r - front + m)
        edge = out.narrow(dim, r, 1)
        if last > first:
            torch.sum(x.narrow(dim, first, last - first), dim, keepdim=True, out=edge)
        else:
            edge.zero_()
    return out


# What the pooled conv and linear Functions keep on ``ctx``, saved and read back one way.
def save_pooled_input(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, packed: tuple[tuple[Tensor, ...], TensorMeta] | None,
                      storage: Storage) -> None:
    """What the pooled conv / linear functions keep: the weight and the packed pooled input
    (None when no weight gradient is wanted) as saved tensors, shapes and flags on ctx."""
    tensors, ctx.pooled_meta = packed if packed is not None else ((), None)
    ctx.save_for_backward(weight, *tensors)
    ctx.storage, ctx.x_shape, ctx.has_bias = storage, tuple(x.shape), bias is not None


def saved_pooled_input(ctx) -> tuple[Tensor, Tensor | None, tuple[int, ...], tuple[bool, bool, bool]]:
    """(weight, pooled input or None, input shape, which of input / weight / bias gradients)."""
    weight, *packed = ctx.saved_tensors
    pooled = unpack_tensor(packed, ctx.storage, ctx.pooled_meta) if packed else None
    return weight, pooled, ctx.x_shape, (ctx.needs_input_grad[0], bool(packed), ctx.has_bias and ctx.needs_input_grad[2])
