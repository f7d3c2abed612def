"""Autograd functions whose forward is exact but whose saved tensors are compressed.

Every tensor that backward needs goes through ``ctx.save_for_backward`` so that saved-tensor hooks
(``measure_memory``, checkpointing, offloading) see it; only shapes and scalars live on ``ctx``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.kernels import triton as triton_kernels
from lessmem.core.layout import format_of, is_channels_last, is_dense
from lessmem.core.storage import Storage, pack_tensor, unpack_tensor

Pair = tuple[int, int]

# ---------------------------------------------------------------------------------------------
# Pooling helpers
# ---------------------------------------------------------------------------------------------


def pool_blocks(x: Tensor, kernel: Pair) -> Tensor:
    """k×k block means. ``ceil_mode`` keeps partial edge blocks, averaged over their true size."""
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
    return F.avg_pool1d(x.transpose(-1, -2).reshape(-1, 1, x.shape[-2]), k, k, ceil_mode=True).view(
        *x.shape[:-2], x.shape[-1], -1
    ).transpose(-1, -2)


def expand_tokens(pooled: Tensor, k: int, tokens: int) -> Tensor:
    return pooled.repeat_interleave(k, dim=-2)[..., :tokens, :]


# Pooled copies of one input shared by several layers (ResNet's conv1 and downsample both read the
# block input): the second layer reuses the first one's tensor, so it is stored once.
_CACHE_ATTR = "_lessmem_pooled"


def pooled_once(x: Tensor, kernel: Pair, storage: Storage) -> tuple[Tensor, ...]:
    if torch.compiler.is_compiling():  # the compiler de-duplicates; tensor attributes would break graphs
        return pack_tensor(pool_blocks(x.detach(), kernel), storage)
    key = (kernel, storage, x._version)
    cache = getattr(x, _CACHE_ATTR, None)
    if cache is not None and key in cache:
        return cache[key]
    packed = pack_tensor(pool_blocks(x.detach(), kernel), storage)
    if cache is None or next(iter(cache))[2] != x._version:
        cache = {}
        setattr(x, _CACHE_ATTR, cache)
    cache[key] = packed
    return packed


# ---------------------------------------------------------------------------------------------
# Convolution
# ---------------------------------------------------------------------------------------------


def _save_pooled(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, packed: tuple[Tensor, ...],
                 storage: Storage) -> None:
    """What the pooled conv / linear functions keep: the weight and the packed pooled input
    (empty when no weight gradient is wanted) as saved tensors, shapes and flags on ctx."""
    ctx.save_for_backward(weight, *packed)
    ctx.storage, ctx.x_meta, ctx.has_bias = storage, (tuple(x.shape), x.dtype), bias is not None


def _saved_pooled(ctx) -> tuple[Tensor, Tensor | None, tuple[int, ...], tuple[bool, bool, bool]]:
    """(weight, pooled input or None, input shape, which of input / weight / bias gradients)."""
    weight, *packed = ctx.saved_tensors
    shape, dtype = ctx.x_meta
    pooled = unpack_tensor(packed, ctx.storage, dtype) if packed else None
    return weight, pooled, shape, (ctx.needs_input_grad[0], bool(packed), ctx.has_bias and ctx.needs_input_grad[2])


class PooledConv2dFunction(torch.autograd.Function):
    """conv2d whose input is saved only as k×k block means.

    Backward: the input gradient needs only the weight, so it is exact; the weight gradient is
    computed from the block means repeated over each block (the paper's approximation).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, kernel, storage):
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        packed = pooled_once(x, kernel, storage) if ctx.needs_input_grad[1] else ()
        _save_pooled(ctx, x, weight, bias, packed, storage)
        ctx.conv, ctx.kernel = (stride, padding, dilation, groups), kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, pooled, shape, needs = _saved_pooled(ctx)
        gx, gw, gb = pooled_conv_grads(grad_out, pooled, shape, weight, ctx.has_bias, *ctx.conv,
                                       ctx.kernel, needs)
        return gx, gw, gb, None, None, None, None, None, None


def pooled_conv_grads(grad_out, pooled, shape, weight, has_bias, stride, padding, dilation, groups,
                      kernel, needs):
    """(input, weight, bias) gradients of conv2d whose input (of ``shape``) is known only by its
    k×k block means ``pooled`` (None when no weight gradient is wanted).

    When the blocks tile the input and the conv stride divides k, the weight gradient is taken
    on the pooled grid (``_block_weight_grad``): k²/stride² fewer multiply-adds than on the
    expanded input and no full-size copy; otherwise the means are expanded first."""
    gw = None
    if needs[1] and _depthwise_kernel_takes(grad_out, pooled, shape, weight, groups, kernel, stride):
        gw = cpu_kernels.depthwise_weight_grad(grad_out, pooled, weight.shape[2:], stride, padding, dilation,
                                               kernel)
    elif needs[1] and _block_grid_fits(shape, kernel, stride) and _block_path_pays(grad_out, weight, groups,
                                                                                  kernel, stride):
        gw = _block_weight_grad(grad_out, pooled, shape, weight, stride, padding, dilation, groups, kernel)
    if gw is None:
        # Small inputs (per-op overhead dominates), layers where the passes over the output gradient
        # would cost more than they save, and geometries the pooled grid does not take: expand the
        # means and make one convolution_backward call for all three gradients.
        x_hat = expand_blocks(pooled, kernel, shape[2:]) if needs[1] else _input_like(grad_out, shape)
        return conv_grads(grad_out, x_hat, weight, has_bias, stride, padding, dilation, groups, needs)
    gx = None
    if needs[0]:
        gx = conv_grads(grad_out, _input_like(grad_out, shape), weight, False, stride, padding,
                        dilation, groups, (True, False, False))[0]
    return gx, gw, grad_out.sum((0, 2, 3)) if needs[2] else None


def _input_like(grad_out: Tensor, shape) -> Tensor:
    """An uninitialised stand-in for the conv input: the input gradient reads only the weight,
    so any tensor of the input's shape (and grad_out's layout) will do."""
    return torch.empty(shape, dtype=grad_out.dtype, device=grad_out.device, memory_format=format_of(grad_out))


# The pooled-grid weight gradient saves multiply-adds in proportion to output positions × weight
# size, and costs a few extra passes over the weight (gradient layout, tap gather): below this
# many output positions the expanding path is faster (measured on CPU, resnet18 at 64 px).
BLOCK_PATH_MIN_POSITIONS = 256


def _depthwise_kernel_takes(grad_out, pooled, shape, weight, groups, kernel: Pair, stride: Pair) -> bool:
    """Depthwise convs (one input and one output channel per group) on CPU, NCHW, blocks tiling the
    input: the C++ kernel expands each channel's means in cache and reads the output gradient once
    (the pooled grid saves them nothing, the expanded copy costs a full pass). Strided ones only
    from 16 outputs per row: below that its per-row loop is slower than expanding."""
    return (groups > 1 and weight.shape[0] == groups and weight.shape[1] == 1
            and shape[2] % kernel[0] == 0 and shape[3] % kernel[1] == 0
            and (tuple(stride) == (1, 1) or grad_out.shape[3] >= 16)
            and grad_out.is_contiguous() and pooled.is_contiguous() and cpu_kernels.enabled_for(grad_out))


def _block_path_pays(grad_out: Tensor, weight: Tensor, groups: int, kernel: Pair, stride: Pair) -> bool:
    """Cost model for the pooled-grid weight gradient against expanding the means (CPU, fitted to
    resnet18 / mobilenet_v2 layers). With m = k/stride > 1 it saves (1 - 1/m²)·ipg·taps multiply-
    adds per output-gradient value but makes ~3 passes over the output gradient (padding, window
    sums), where expanding makes ~2 over the input; one pass costs about 10 multiply-adds per value.
    So 1×1 convs with few input channels per output channel expand, and depthwise convs where the
    C++ depthwise kernel does not take them."""
    positions = grad_out.numel() // max(1, grad_out.shape[1])  # n · output height · width
    if positions < BLOCK_PATH_MIN_POSITIONS:
        return False
    m2 = (kernel[0] // stride[0]) * (kernel[1] // stride[1])
    if m2 == 1:  # block grid = output grid: no passes over the output gradient
        return True
    ipg, opg, taps = weight.shape[1], weight.shape[0] // groups, weight.shape[2] * weight.shape[3]
    return 30 - 20 * ipg / opg < (1 - 1 / m2) * ipg * taps


def _block_grid_fits(shape, kernel: Pair, stride: Pair) -> bool:
    return all(size % k == 0 and k % s == 0 for size, k, s in zip(shape[2:], kernel, stride, strict=True))


def _block_weight_grad(grad_out, pooled, shape, weight, stride, padding, dilation, groups, kernel):
    """Weight gradient of conv2d on the block-constant input, computed on the pooled grid, or
    None where that would not pay (the caller then expands the block means).

    gw[o, i, th, tw] = sum over outputs of grad_out * x_hat at the tap's input position, and
    x_hat is constant on k×k blocks. With m = k/stride > 1, per tap the m×m outputs that read
    one block are summed first (a sum-pool of grad_out read at a per-tap offset), then multiplied
    with the block means, for all distinct read offsets at once: as one matrix product (few blocks
    per input channel) or as one conv weight gradient with the roles swapped (many blocks, or
    groups): k²/stride² fewer multiply-adds than the weight gradient on the expanded input and no
    full-size expanded copy. With m = 1 (stride = k) output and block grids coincide: one
    stride-1 conv weight gradient on the pooled grid whose taps are the distinct block shifts.
    Blocks in the conv's zero padding contribute nothing."""
    n, o, ho, wo = grad_out.shape
    ipg, kh, kw = weight.shape[1], weight.shape[2], weight.shape[3]
    hb, wb = shape[2] // kernel[0], shape[3] // kernel[1]
    rows, (fh, bh), mh = _tap_reads(kh, kernel[0], stride[0], dilation[0], padding[0], ho, hb)
    cols, (fw, bw), mw = _tap_reads(kw, kernel[1], stride[1], dilation[1], padding[1], wo, wb)
    if mh == mw == 1:
        return _weight_grad_block_shifts(grad_out, pooled, weight, groups, rows, cols, fh, fw)
    # Distinct read offsets per axis (taps can share one when stride > 1).
    r0, c0 = min(rows), min(cols)
    sh, sw = max(rows) - r0 + 1, max(cols) - c0 + 1
    if sh * sw > 3 * mh * mw:  # the gradient sums per offset would outweigh the gradient itself
        return None
    # g[.., r, c]: sum of the m×m window at (r, c) of grad_out zero-padded by (front, back)
    g = sum_windows(sum_windows(grad_out, mh, 2, fh, bh), mw, 3, fw, bw)
    taps = [(r - r0) * sw + c - c0 for r in rows for c in cols]  # tap -> its read offset
    if groups > 1 or n * hb * wb >= SWAPPED_CONV_MIN_BLOCKS_PER_CHANNEL * ipg:
        return _weight_grad_swapped_conv(g, pooled, weight, groups, (r0, c0), (sh, sw), taps, (mh, mw))
    # win[n, o, b, b', j, j'] = g[n, o, b·mh + r0 + j, b'·mw + c0 + j']: per read offset (j, j'),
    # the gradient sums that meet block (b, b')
    win = g[:, :, r0:, c0:].unfold(2, sh, mh)[:, :, :hb].unfold(3, sw, mw)[:, :, :, :wb]
    offsets, blocks = sh * sw, n * hb * wb
    means = pooled.permute(0, 2, 3, 1).reshape(blocks, ipg)
    # one matrix product for all offsets, the operand copied in the order its source is laid out
    if is_channels_last(g):
        per_offset = win.permute(0, 2, 3, 4, 5, 1).reshape(blocks, offsets * o).t() @ means
    else:
        per_offset = win.permute(4, 5, 1, 0, 2, 3).reshape(offsets * o, blocks) @ means
    gw = per_offset.reshape(offsets, o * ipg).index_select(0, torch.tensor(taps, device=g.device))
    return gw.view(kh, kw, o, ipg).permute(2, 3, 0, 1).contiguous(memory_format=format_of(weight))


# Blocks per input channel above which the window-sum × block-mean products run as one conv
# weight gradient (no copy of the sums per read offset): measured on CPU, resnet18 / resnet20
# layers; below it the copy is small and one matrix product is faster.
SWAPPED_CONV_MIN_BLOCKS_PER_CHANNEL = 16


def _weight_grad_swapped_conv(g, pooled, weight, groups, origin: Pair, span: Pair, taps: list[int], m: Pair):
    """m > 1: gw[o, i, t] = sum over blocks b of g[o, b·m + start_t] · means[i, b] is the weight
    gradient of a stride-m conv with the roles swapped (window sums ``g`` as the input, block
    means as the output gradient, same groups) over the span × span distinct read offsets from
    ``origin``; ``taps`` maps each tap to its offset. It comes out (in, out)-major per group and
    is transposed."""
    (r0, c0), (sh, sw) = origin, span
    hb, wb = pooled.shape[2:]
    o, ipg, kh, kw = weight.shape
    g = g[:, :, r0: r0 + (hb - 1) * m[0] + sh, c0: c0 + (wb - 1) * m[1] + sw]
    swapped = torch.ops.aten.convolution_backward(
        pooled, g, weight.new_empty(()).expand(groups * ipg, o // groups, sh, sw), None,
        m, (0, 0), (1, 1), False, [0, 0], groups, [False, True, False])[1]
    gw = swapped.view(groups, ipg, o // groups, sh * sw).transpose(1, 2)
    if taps != list(range(sh * sw)):
        # one gather (offsets run backwards over the taps, and taps share them when stride > 1);
        # it writes a fresh contiguous (groups, out, in, taps) tensor: the transpose comes free
        gw = gw.index_select(3, torch.tensor(taps, device=g.device))
    return gw.reshape(o, ipg, kh, kw).contiguous(memory_format=format_of(weight))


def _weight_grad_block_shifts(grad_out, pooled, weight, groups, rows, cols, fh, fw):
    """m = 1: tap t meets block y + q_t at output y (q_t = front - start_t), so the taps'
    gradients are a stride-1 conv weight gradient of grad_out against the zero-padded block
    means over the distinct shifts q, gathered per tap."""
    qh, qw = [fh - r for r in rows], [fw - c for c in cols]
    top, left = -min(qh), -min(qw)
    kh, kw = max(qh) + top + 1, max(qw) + left + 1
    ho, wo = grad_out.shape[2:]
    p = F.pad(pooled, (left, wo + kw - 1 - pooled.shape[3] - left, top, ho + kh - 1 - pooled.shape[2] - top))
    sub = torch.ops.aten.convolution_backward(
        grad_out, p, weight.new_empty(()).expand(weight.shape[0], weight.shape[1], kh, kw), None,
        (1, 1), (0, 0), (1, 1), False, [0, 0], groups, [False, True, False])[1]
    taps = [(q_h + top) * kw + q_w + left for q_h in qh for q_w in qw]
    if taps == list(range(kh * kw)):
        return sub
    # one index_select over the flattened taps: far faster than 2-d advanced indexing on CPU
    return sub.reshape(-1, kh * kw).index_select(1, torch.tensor(taps, device=sub.device)).view(
        sub.shape[0], sub.shape[1], len(qh), len(qw))


def _tap_reads(taps: int, k: int, s: int, d: int, pad: int, size_out: int, blocks: int):
    """Along one axis, with m = k/s: tap t reads, for output y, input row y*s + t*d - pad, which
    lies in block b exactly for the m outputs y = b*m - q_t + j (j < m), q_t = floor((t*d -
    pad) / s). So with the output gradient zero-padded by (front, back) and summed over windows
    of m, tap t's sum for block b sits at row b*m + start_t. Returns ([start_t], (front, back), m)."""
    m = k // s
    q = [(t * d - pad) // s for t in range(taps)]
    front = max(0, *q)
    back = max(0, blocks * m - min(q) - size_out)
    return [front - qt for qt in q], (front, back), m


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


def conv_grads(grad_out, x_hat, weight, has_bias, stride, padding, dilation, groups, needs):
    """(input, weight, bias) gradients of conv2d, the weight gradient taken on ``x_hat``. The
    input gradient reads only the weight, so it is exact whatever ``x_hat`` is."""
    return torch.ops.aten.convolution_backward(
        grad_out, x_hat, weight, [weight.shape[0]] if has_bias else None,
        stride, padding, dilation, False, [0, 0], groups, list(needs),
    )


def linear_grads(grad_out, x_hat, weight, needs):
    """(input, weight, bias) gradients of linear on (..., tokens, features), the weight gradient
    taken on ``x_hat`` (None when not needed); ``needs`` says which to compute."""
    flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
    gx = grad_out @ weight if needs[0] else None
    gw = flat_grad.t() @ x_hat.reshape(-1, x_hat.shape[-1]) if needs[1] else None
    gb = flat_grad.sum(0) if needs[2] else None
    return gx, gw, gb


class PooledLinearFunction(torch.autograd.Function):
    """linear whose input (..., tokens, features) is saved as means over groups of k tokens."""

    @staticmethod
    def forward(ctx, x, weight, bias, k, storage):
        out = F.linear(x, weight, bias)
        packed = pack_tensor(pool_tokens(x.detach(), k), storage) if ctx.needs_input_grad[1] else ()
        _save_pooled(ctx, x, weight, bias, packed, storage)
        ctx.k = k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, pooled, shape, needs = _saved_pooled(ctx)
        x_hat = expand_tokens(pooled, ctx.k, shape[-2]) if pooled is not None else None
        return (*linear_grads(grad_out, x_hat, weight, needs), None, None)


# ---------------------------------------------------------------------------------------------
# Exact companions: activations and max-pooling that keep bits or small indices, not tensors
# ---------------------------------------------------------------------------------------------

# 8 flags (bytes 0/1) in one int64 word -> one byte: multiplying by this constant moves byte i's
# bit to bit 56 + i with no carries (each product term lands on its own bit), then >> 56.
_GATHER = 0x0102040810204080
_SPREAD = 0x0101010101010101  # one byte -> the same byte in all 8 lanes
_SELECT = 0x8040201008040201 - 2**64  # lane i keeps bit i (as a signed int64 constant)


def pack_bits(mask: Tensor) -> Tensor:
    """Bool tensor -> uint8 tensor with 8 flags per byte (1 bit per element, element i of each
    group of 8 in bit i)."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.uint8).view(torch.int64)
    return ((words * _GATHER) >> 56).to(torch.uint8)


def unpack_bits(packed: Tensor, shape: torch.Size) -> Tensor:
    words = (packed.to(torch.int64) * _SPREAD) & torch.tensor(_SELECT, device=packed.device)
    return words.view(torch.uint8).view(-1)[: shape.numel()].view(shape).bool()


def _fused_mask_kernels(t: Tensor):
    """The fused mask kernels for ``t`` (Triton on CUDA, C++ on CPU), or None for the reference."""
    return next((k for k in (triton_kernels, cpu_kernels) if k.enabled_for(t)), None)


def clamp_and_pack(x: Tensor, lo: float, hi: float | None, inplace: bool = False) -> tuple[Tensor, Tensor, bool]:
    """(clamp(x, lo, hi), its pass mask packed 8 flags per byte in memory order, whether that
    order is channels-last). One fused pass where a kernel takes x (they walk memory order)."""
    fused = _fused_mask_kernels(x) if is_dense(x) else None
    if fused is not None:
        return (*fused.clamp_and_pack(x, lo, hi, inplace), is_channels_last(x))
    if inplace:
        y = torch.clamp_(x, lo, hi) if hi is not None else torch.relu_(x)
    else:
        y = torch.clamp(x, lo, hi) if hi is not None else torch.relu(x)
    passed = (y > lo) if hi is None else (y > lo) & (y < hi)
    # Pack in memory order: a channels-last mask is packed as NHWC, with no layout copy.
    channels_last = is_channels_last(passed)
    return y, pack_bits(passed.permute(0, 2, 3, 1) if channels_last else passed), channels_last


def masked_grad(grad: Tensor, bits: Tensor, channels_last: bool) -> Tensor:
    """``grad`` where the packed pass bit is set, else 0 (bits from ``clamp_and_pack``)."""
    fused = _fused_mask_kernels(grad)
    if fused is not None:
        return fused.masked_grad(grad, bits, channels_last)
    if not channels_last:
        return grad * unpack_bits(bits, grad.shape)
    # the product takes grad's layout; mixed layouts downstream (BatchNorm) are slow
    grad = grad.contiguous(memory_format=torch.channels_last)
    # grad * mask: 3-4x faster than torch.where on CPU (channels-last); equal values except
    # that non-finite grads at masked positions give NaN instead of 0 (and 0 may be -0.0).
    return grad * unpack_bits(bits, grad.permute(0, 2, 3, 1).shape).permute(0, 3, 1, 2)


class MaskedActivationFunction(torch.autograd.Function):
    """Piecewise-linear activation (ReLU, ReLU6, Hardtanh) that saves a 1-bit pass mask.

    The mask is derived from the output, which is what stock autograd uses too, so gradients are
    bit-identical to stock.
    """

    @staticmethod
    def forward(ctx, x, lo, hi, inplace):
        if inplace:
            ctx.mark_dirty(x)
        y, bits, ctx.channels_last = clamp_and_pack(x, lo, hi, inplace)
        ctx.save_for_backward(bits)
        return y

    @staticmethod
    def backward(ctx, grad):
        (bits,) = ctx.saved_tensors
        return masked_grad(grad, bits, ctx.channels_last), None, None, None


class CompactMaxPool2dFunction(torch.autograd.Function):
    """max_pool2d that saves the argmax position inside each window as uint8 (not the input and
    int64 plane indices, as stock does). The gradient is scattered exactly like stock."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, ceil_mode):
        h, w = x.shape[-2:]
        ctx.geometry = (kernel, stride, padding, dilation, (h, w), tuple(x.shape))
        out_hw = [_pooled_size(*a, ceil_mode) for a in zip((h, w), kernel, stride, padding, dilation, strict=True)]
        # arguments stock would reject (padding over half the kernel, empty output) take the stock
        # path below, which raises its own error
        valid = all(p <= k // 2 for p, k in zip(padding, kernel, strict=True)) and min(out_hw) > 0
        ctx.fused = valid and x.dim() == 4 and x.is_contiguous() and cpu_kernels.enabled_for(x)
        if ctx.fused:
            out, local = cpu_kernels.max_pool_compact(x, kernel, stride, padding, dilation, out_hw)
            ctx.save_for_backward(local)
            return out
        out, idx = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        row0, col0 = _window_origins(out.shape[-2:], stride, padding, x.device)
        flat = idx.to(torch.int32)  # int32 arithmetic: half the memory traffic of int64
        r = flat // w
        col_off, row_off = flat.sub_(r * w).sub_(col0), r.sub_(row0)  # argmax offset in its window
        if dilation != (1, 1):
            col_off, row_off = col_off // dilation[1], row_off // dilation[0]
        local = row_off.mul_(kernel[1]).add_(col_off)
        ctx.save_for_backward(local.to(torch.uint8))
        return out

    @staticmethod
    def backward(ctx, grad):
        (local,) = ctx.saved_tensors
        kernel, stride, padding, dilation, (h, w), shape = ctx.geometry
        if ctx.fused:
            gx = cpu_kernels.max_pool_compact_backward(grad, local, kernel, stride, padding, dilation, (h, w))
            return gx, None, None, None, None, None
        row0, col0 = _window_origins(grad.shape[-2:], stride, padding, grad.device)
        # plane index = window origin + offset of the argmax inside the window (a small table)
        i = torch.arange(kernel[0], device=grad.device)[:, None] * dilation[0]
        j = torch.arange(kernel[1], device=grad.device)[None, :] * dilation[1]
        offsets = (i * w + j).flatten()
        idx = (offsets[local.long()] + (row0 * w + col0)).flatten(-2)
        gx = grad.new_zeros(*shape[:-2], h * w)
        gx.scatter_add_(-1, idx, grad.flatten(-2))
        return gx.view(shape), None, None, None, None, None


def _pooled_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """Output length of max-pooling along one axis, as PyTorch computes it."""
    span = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = span // s + 1
    if ceil_mode and (out - 1) * s >= size + p:  # the last window must start inside the input
        out -= 1
    return out


def _window_origins(out_hw, stride: Pair, padding: Pair, device) -> tuple[Tensor, Tensor]:
    rows = torch.arange(out_hw[0], device=device) * stride[0] - padding[0]
    cols = torch.arange(out_hw[1], device=device) * stride[1] - padding[1]
    return rows[:, None], cols[None, :]


# ---------------------------------------------------------------------------------------------
# BatchNorm with a lower-precision copy of its input (approximate, opt-in)
# ---------------------------------------------------------------------------------------------


class StoredBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm that keeps its input as bf16 or 8-bit codes instead of fp32.

    Approximate: the input gradient uses the dequantized input, so error propagation is no longer
    exact. Opt-in through ``norm_storage``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, storage):
        out, mean, invstd = torch.ops.aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, True, momentum, eps
        )
        ctx.save_for_backward(weight, mean, invstd, *pack_tensor(x.detach(), storage))
        ctx.eps, ctx.storage, ctx.dtype = eps, storage, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, mean, invstd, *packed = ctx.saved_tensors
        x = unpack_tensor(packed, ctx.storage, ctx.dtype)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad.contiguous(), x, weight, None, None, mean, invstd, True, ctx.eps, mask
        )
        return gx, gw, gb, None, None, None, None, None
