"""The weight gradient of a conv whose input is known by its k×k block means, taken on the pooled
grid: no full-size expanded copy, k²/stride² fewer multiply-adds than on the expanded input."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lessmem.core.layout import format_of, is_channels_last
from lessmem.core.ops.pooling import Pair, sum_windows

# Blocks per input channel above which the window-sum × block-mean products run as one conv
# weight gradient (no copy of the sums per read offset): measured on CPU, resnet18 / resnet20
# layers; below it the copy is small and one matrix product is faster.
SWAPPED_CONV_MIN_BLOCKS_PER_CHANNEL = 16


def block_weight_grad(grad_out, pooled, shape, weight, stride, padding, dilation, groups, kernel):
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
