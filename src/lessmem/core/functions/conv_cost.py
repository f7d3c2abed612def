"""Which weight-gradient path a pooled conv takes: the C++ depthwise kernel, the pooled grid, or
expanding the block means (a cost model fitted on CPU)."""

from __future__ import annotations

from torch import Tensor

from lessmem.core.functions.pooling import Pair
from lessmem.core.kernels import cpu as cpu_kernels

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
