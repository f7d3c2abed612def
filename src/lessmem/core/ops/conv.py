"""Conv2d that saves its input only as k×k block means: the autograd Function, the gradients it
takes from them, which weight-gradient path a layer takes (the C++ depthwise kernel, the pooled
grid of ``conv_weight_grad``, or expanding the block means: a cost model fitted on CPU), the
Function of a conv that keeps nothing (``from_bn``: its input rebuilt from the layers before it,
``rebuilt_input``), and the swapped-in ``CompressedConv2d``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.layout import format_of
from lessmem.core.ops.conv_weight_grad import block_weight_grad
from lessmem.core.ops.dispatch import autocast_cast, needs_saving, warn_eager
from lessmem.core.ops.owned_grad import grad_target, handed_to
from lessmem.core.ops.pooling import (
    Pair,
    expand_blocks,
    pooled_once,
    save_pooled_input,
    saved_pooled_input,
)
from lessmem.core.ops.rebuilt_input import claim, rebuilt_samples
from lessmem.core.spec import FROM_NORM, LayerSpec
from lessmem.core.storage import sliceable, unpack_samples

# Output-gradient elements from which a layer with no input gradient takes its weight gradient in
# batch slices, and the slice size: a few MiB of scratch instead of a full-size one.
CHUNKED_WEIGHT_GRAD_MIN = 2**22
WEIGHT_GRAD_CHUNK = 2**21


class PooledConv2dFunction(torch.autograd.Function):
    """conv2d whose input is saved only as k×k block means.

    Backward: the input gradient needs only the weight, so it is exact; the weight gradient is
    computed from the block means repeated over each block (the paper's approximation). The
    input gradient is fresh: it is handed to the node before (``owned_grad``).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, kernel, storage):
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        packed = pooled_once(x, kernel, storage) if ctx.needs_input_grad[1] else None
        save_pooled_input(ctx, x, weight, bias, packed, storage)
        ctx.conv, ctx.kernel = (stride, padding, dilation, groups), kernel
        ctx.grad_target = grad_target(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if sliced_weight_grad_takes(ctx):
            return sliced_conv_grads(ctx, grad_out)
        weight, pooled, shape, needs = saved_pooled_input(ctx)
        gx, gw, gb = pooled_conv_grads(grad_out, pooled, shape, weight, ctx.has_bias, *ctx.conv,
                                       ctx.kernel, needs)
        return handed_to(gx, ctx.grad_target), gw, gb, None, None, None, None, None, None


class RebuiltInputConv2dFunction(torch.autograd.Function):
    """conv2d that keeps nothing of its input: backward rebuilds it from the BatchNorm code and
    ReLU mask before it (``rebuilt_input``, saved here by reference: no bytes of its own), a
    batch slice at a time, for the weight gradient. The input gradient reads only the weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups, found):
        out = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        ctx.source, saved = found  # ``claim``'s: the note and the tensors it names
        ctx.save_for_backward(weight, *saved)
        ctx.conv, ctx.x_shape, ctx.has_bias = (stride, padding, dilation, groups), tuple(x.shape), bias is not None
        ctx.grad_target = grad_target(x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, *saved = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.conv
        gw = None
        if ctx.needs_input_grad[1]:
            samples = rebuilt_samples(ctx.source, saved, ctx.x_shape)
            gw = chunked_weight_grad(grad_out, lambda s, e: samples(s, e).to(grad_out.dtype), weight, stride, padding,
                                     dilation, groups)
        gx = input_grad(grad_out, weight, ctx.x_shape, stride, padding, dilation, groups) if ctx.needs_input_grad[0] else None
        gb = grad_out.sum((0, 2, 3)) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return handed_to(gx, ctx.grad_target), gw, gb, None, None, None, None, None


def sliced_weight_grad_takes(ctx) -> bool:
    """Kernel 1 (the input itself packed, the int maps) where samples start on a code group: the
    weight gradient is taken a batch slice at a time from the packed input (one slice for a
    small layer: the plain weight gradient on the decoded input)."""
    return (tuple(ctx.kernel) == (1, 1) and ctx.pooled_meta is not None and len(ctx.x_shape) == 4
            and sliceable(ctx.pooled_meta, ctx.storage))


def sliced_conv_grads(ctx, grad_out: Tensor):
    """Backward of a kernel-1 conv from its packed input, decoded one batch slice at a time for
    the weight gradient: no full-size decoded copy, padded copy or backend scratch of the
    input. The input gradient reads only the weight (exact, one call)."""
    weight, *packed = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv
    gw = chunked_weight_grad(
        grad_out, lambda s, e: unpack_samples(packed, ctx.storage, ctx.pooled_meta, s, e),
        weight, stride, padding, dilation, groups)
    gx = input_grad(grad_out, weight, ctx.x_shape, stride, padding, dilation, groups) if ctx.needs_input_grad[0] else None
    gb = grad_out.sum((0, 2, 3)) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return handed_to(gx, ctx.grad_target), gw, gb, None, None, None, None, None, None


def pooled_conv_grads(grad_out, pooled, shape, weight, has_bias, stride, padding, dilation, groups,
                      kernel, needs):
    """(input, weight, bias) gradients of conv2d whose input (of ``shape``) is known only by its
    k×k block means ``pooled`` (None when no weight gradient is wanted).

    When the blocks tile the input and the conv stride divides k, the weight gradient is taken
    on the pooled grid (``block_weight_grad``): k²/stride² fewer multiply-adds than on the
    expanded input and no full-size copy; otherwise the means are expanded first."""
    gw = None
    if needs[1] and depthwise_kernel_takes(grad_out, pooled, shape, weight, groups, kernel, stride):
        gw = cpu_kernels.depthwise_weight_grad(grad_out, pooled, weight.shape[2:], stride, padding, dilation,
                                               kernel)
    elif needs[1] and block_grid_fits(shape, kernel, stride) and block_path_pays(grad_out, weight, groups,
                                                                                kernel, stride):
        gw = block_weight_grad(grad_out, pooled, shape, weight, stride, padding, dilation, groups, kernel)
    if gw is None and needs[1]:
        # Small inputs (per-op overhead dominates), layers where the passes over the output gradient
        # would cost more than they save, and geometries the pooled grid does not take: expand the
        # means and make one convolution_backward call for all three gradients.
        x_hat = expand_blocks(pooled, kernel, shape[2:])
        if not needs[0] and grad_out.numel() >= CHUNKED_WEIGHT_GRAD_MIN:
            gw = chunked_weight_grad(grad_out, lambda s, e: x_hat[s:e], weight, stride, padding, dilation, groups)
            return None, gw, grad_out.sum((0, 2, 3)) if needs[2] else None
        return conv_grads(grad_out, x_hat, weight, has_bias, stride, padding, dilation, groups, needs)
    gx = input_grad(grad_out, weight, shape, stride, padding, dilation, groups) if needs[0] else None
    return gx, gw, grad_out.sum((0, 2, 3)) if needs[2] else None


def chunked_weight_grad(grad_out, inputs: Callable[[int, int], Tensor], weight, stride, padding, dilation,
                        groups) -> Tensor:
    """The weight gradient summed over batch slices of ``WEIGHT_GRAD_CHUNK`` output elements,
    ``inputs(start, stop)`` giving the input's samples: the backend's scratch copies (a full-size
    reorder of the output gradient on CPU) and a decoded input then stay slice-sized."""
    n = grad_out.shape[0]
    step = max(1, WEIGHT_GRAD_CHUNK // grad_out[0].numel())
    gw = None
    for s in range(0, n, step):
        e = min(n, s + step)
        part = conv_grads(grad_out[s:e], inputs(s, e), weight, False, stride, padding,
                          dilation, groups, (False, True, False))[1]
        gw = part if gw is None else gw.add_(part)
    return gw


def input_grad(grad_out, weight, shape, stride, padding, dilation, groups) -> Tensor:
    """conv2d's input gradient as the transposed conv of ``grad_out``: it reads only the weight,
    so no stand-in for the input is allocated (``convolution_backward`` wants one). A large one
    is written a batch slice at a time: the backend's full-size scratch (a reorder on CPU)
    then stays slice-sized."""
    extra = [size - ((o - 1) * s - 2 * p + d * (k - 1) + 1)
             for size, o, s, p, d, k in zip(shape[2:], grad_out.shape[2:], stride, padding, dilation,
                                            weight.shape[2:], strict=True)]
    per_sample = math.prod(shape[1:])
    n = shape[0]
    if n * per_sample < CHUNKED_WEIGHT_GRAD_MIN or n == 1:
        return F.conv_transpose2d(grad_out, weight, None, stride, padding, extra, groups, dilation)
    step = max(1, WEIGHT_GRAD_CHUNK // per_sample)
    gx = None
    for s in range(0, n, step):
        part = F.conv_transpose2d(grad_out[s: s + step], weight, None, stride, padding, extra, groups, dilation)
        if gx is None:
            gx = torch.empty(shape, dtype=part.dtype, device=part.device, memory_format=format_of(part))
        gx[s: s + step] = part
    return gx


def conv_grads(grad_out, x_hat, weight, has_bias, stride, padding, dilation, groups, needs):
    """(input, weight, bias) gradients of conv2d, the weight gradient taken on ``x_hat``. The
    input gradient reads only the weight, so it is exact whatever ``x_hat`` is."""
    return torch.ops.aten.convolution_backward(
        grad_out, x_hat, weight, [weight.shape[0]] if has_bias else None,
        stride, padding, dilation, False, [0, 0], groups, list(needs),
    )


# The pooled-grid weight gradient saves multiply-adds in proportion to output positions × weight
# size, and costs a few extra passes over the weight (gradient layout, tap gather): below this
# many output positions the expanding path is faster (measured on CPU, resnet18 at 64 px).
BLOCK_PATH_MIN_POSITIONS = 256


def depthwise_kernel_takes(grad_out, pooled, shape, weight, groups, kernel: Pair, stride: Pair) -> bool:
    """Depthwise convs (one input and one output channel per group) on CPU, NCHW, blocks tiling the
    input: the C++ kernel expands each channel's means in cache and reads the output gradient once
    (the pooled grid saves them nothing, the expanded copy costs a full pass). Strided ones only
    from 16 outputs per row: below that its per-row loop is slower than expanding."""
    return (groups > 1 and weight.shape[0] == groups and weight.shape[1] == 1
            and shape[2] % kernel[0] == 0 and shape[3] % kernel[1] == 0
            and (tuple(stride) == (1, 1) or grad_out.shape[3] >= 16)
            and grad_out.is_contiguous() and pooled.is_contiguous() and cpu_kernels.enabled_for(grad_out))


def block_path_pays(grad_out: Tensor, weight: Tensor, groups: int, kernel: Pair, stride: Pair) -> bool:
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


def block_grid_fits(shape, kernel: Pair, stride: Pair) -> bool:
    """The blocks tile the input and the conv stride divides the block: the pooled grid applies."""
    return all(size % k == 0 and k % s == 0 for size, k, s in zip(shape[2:], kernel, stride, strict=True))


# int8 storage has no compiled kernel: it runs eagerly under torch.compile (a graph break).
_eager_conv = torch.compiler.disable(PooledConv2dFunction.apply)


class CompressedConv2d(nn.Conv2d):
    """Conv2d that saves its input pooled by ``lessmem_spec.kernel`` for the weight gradient (or,
    with storage ``from_bn``, nothing: rebuilt in backward from the BatchNorm and ReLU before it)."""

    lessmem_spec: LayerSpec

    def forward(self, x: Tensor) -> Tensor:
        if not needs_saving(x, self):
            return super().forward(x)
        if self.lessmem_spec.storage == FROM_NORM:
            return self._rebuilt_input_forward(x)
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        elif isinstance(padding, str):
            x, padding = _explicit_padding(x, padding, self.kernel_size, self.dilation)
        x, w, b = autocast_cast(x, self.weight, self.bias)
        spec = self.lessmem_spec
        args = (x, w, b, self.stride, padding, self.dilation, self.groups, spec.kernel, spec.storage)
        if torch.compiler.is_compiling():
            if spec.storage not in ("native", "bf16"):
                warn_eager(self, f"{spec.storage} storage")
                return _eager_conv(*args)
            pooled = torch.ops.lessmem.pool_blocks(x.detach(), list(spec.kernel), spec.storage)
            return torch.ops.lessmem.conv2d_keep_pooled(
                x, pooled, w, b, list(self.stride), list(padding), list(self.dilation), self.groups,
                list(spec.kernel),
            )
        with torch.autocast(x.device.type, enabled=False):
            return PooledConv2dFunction.apply(*args)

    def _rebuilt_input_forward(self, x: Tensor) -> Tensor:
        name, padding, symmetric = getattr(self, "lessmem_name", type(self).__name__), self.padding, True
        if isinstance(padding, str):
            padded, padding = _explicit_padding(x, padding, self.kernel_size, self.dilation)
            symmetric = padded is x  # else the conv reads a padded copy, not the input rebuilt
        if self.padding_mode != "zeros" or not symmetric:
            raise ValueError(f"layer {name!r}: storage {FROM_NORM!r} takes zero padding the same on both sides "
                             f"(integers, 'valid', or 'same' with an odd kernel); this conv pads {self.padding!r} "
                             f"({self.padding_mode})")
        found = claim(x, name)  # on x itself: autocast's cast below is another tensor
        x, w, b = autocast_cast(x, self.weight, self.bias)
        with torch.autocast(x.device.type, enabled=False):
            return RebuiltInputConv2dFunction.apply(x, w, b, self.stride, padding, self.dilation, self.groups, found)


def _explicit_padding(x: Tensor, mode: str, kernel, dilation) -> tuple[Tensor, tuple[int, int]]:
    """'valid'/'same' as integers; an asymmetric 'same' pads the input first, as PyTorch does."""
    if mode == "valid":
        return x, (0, 0)
    total = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
    left = [t // 2 for t in total]
    if all(t % 2 == 0 for t in total):
        return x, (left[0], left[1])
    x = F.pad(x, [left[1], total[1] - left[1], left[0], total[0] - left[0]])
    return x, (0, 0)
