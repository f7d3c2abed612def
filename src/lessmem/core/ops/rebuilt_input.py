"""A conv input rebuilt in backward instead of kept (a map's ``from_bn``): where a conv reads
y = ReLU(BatchNorm(x)), the BatchNorm keeps its input x (exact) or a code of it (``norm_storage``)
and the ReLU its 1-bit mask, so y = mask * (gamma * x_hat + beta) is already determined by what those
two keep, and the conv keeps nothing of its own (after ReLU6 / Hardtanh: off the mask, the bound on
the side of gamma * x_hat + beta).

From an exact BatchNorm the rebuilt input is the forward's to float rounding (the kernel's formula
in another order: weight gradients within ~1e-6 of stock's). From a code it is as approximate as
the code: on a trained resnet20 (bn1 -> relu -> conv2 of every block, batch 32) its squared error
relative to y is 0.43 from int2 BatchNorm codes and 0.017 from int4 ones, where an int2 code of y
itself gives 0.12 and int1 1.0. Input gradients stay exact. The layers find each other through
``input_notes``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.ops.input_notes import ClampOfNorm, noted
from lessmem.core.ops.masked_activations import unpack_bits
from lessmem.core.spec import FROM_NORM
from lessmem.core.storage import BITS, samples_of, sliceable, unpack_samples, unpack_tensor


def claim(x: Tensor, layer: str) -> tuple[ClampOfNorm, tuple[Tensor, ...]]:
    """The note on the conv input ``x`` and the tensors it names, alive (bits, mean, invstd,
    BatchNorm weight and bias, code...), or a clear error."""
    source = noted(x, ClampOfNorm)
    if source is None:
        raise ValueError(
            f"layer {layer!r}: storage {FROM_NORM!r} rebuilds the conv input from the BatchNorm and ReLU "
            "right before it, but this input is not the output of a ReLU / ReLU6 / Hardtanh module "
            "(exact_companions on) of a BatchNorm2d (affine, tracking running stats, in training mode) passed "
            "to the conv unchanged, or the conv runs under torch.compile or autocast with an exact BatchNorm "
            "(from_bn is eager only)")
    norm = source.norm
    saved = (source.bits(), norm.mean, norm.invstd, norm.weight, norm.bias, *(r() for r in norm.packed))
    if any(t is None for t in saved):
        raise ValueError(f"layer {layer!r}: the BatchNorm / ReLU before it keep no codes to rebuild from "
                         f"(gradient checkpointing drops saved tensors: {FROM_NORM!r} does not combine with it)")
    return source, saved


def rebuilt_samples(source: ClampOfNorm, saved: tuple[Tensor, ...], shape: tuple[int, ...]) -> Callable[[int, int], Tensor]:
    """A function of (start, stop) giving those samples of the conv input from ``claim``'s
    tensors, each slice decoded on its own where samples start on a code group and a mask byte;
    else the whole input rebuilt once (a full-size transient, as torch's kernels would make)."""
    bits, mean, invstd, weight, bias, *packed = saved
    norm = source.norm
    per_sample = shape[1] * shape[2] * shape[3]
    chan = (1, -1, 1, 1)

    def rebuilt(x: Tensor, mask: Tensor) -> Tensor:
        x_hat = x.float() if norm.normalized else (x.float() - mean.view(chan)).mul_(invstd.view(chan))
        z = x_hat.mul_(weight.view(chan)).add_(bias.view(chan))
        if source.hi is None:  # ReLU: 0 where the mask is off
            return z.mul_(mask).to(norm.meta.dtype)
        # ReLU6 / Hardtanh: off the mask, the bound on z's side (from a code: wrong only where its error
        # exceeds half the range, 3 for ReLU6)
        bound = torch.where(z > (source.lo + source.hi) / 2, source.hi, source.lo)
        return torch.where(mask, z, bound).to(norm.meta.dtype)

    def rebuilt_fused(part: tuple[Tensor, ...], mask: Tensor, size: tuple[int, ...]) -> Tensor:
        out = torch.empty(size, dtype=torch.float32,
                          memory_format=torch.channels_last if norm.meta.channels_last else torch.contiguous_format)
        return cpu_kernels.rebuild_from_norm_codes(part, BITS[norm.storage], mask, weight, bias, source.lo,
                                                   source.hi, out)

    fused = _rebuilds_fused(source, weight, bias)  # one pass from the codes and the mask bits
    if sliceable(norm.meta, norm.storage) and per_sample % 8 == 0:
        if fused:
            return lambda start, stop: rebuilt_fused(
                samples_of(packed, norm.storage, norm.meta, start, stop)[0], bits[start * per_sample // 8:],
                (stop - start, *shape[1:]))
        return lambda start, stop: rebuilt(
            unpack_samples(packed, norm.storage, norm.meta, start, stop),
            _unpacked(bits[start * per_sample // 8: stop * per_sample // 8], source.channels_last, (stop - start, *shape[1:])))
    whole = (rebuilt_fused(tuple(packed), bits, shape) if fused else
             rebuilt(unpack_tensor(packed, norm.storage, norm.meta), _unpacked(bits, source.channels_last, shape)))
    return lambda start, stop: whole[start:stop]


def _rebuilds_fused(source: ClampOfNorm, weight: Tensor, bias: Tensor) -> bool:
    """Whether the fused kernel rebuilds the input: integer codes of x_hat, float32, the mask packed
    in the codes' memory order."""
    norm = source.norm
    return (norm.normalized and norm.meta.dtype == weight.dtype == bias.dtype == torch.float32
            and source.channels_last == norm.meta.channels_last and len(norm.meta.shape) == 4
            and cpu_kernels.enabled_for(weight))


def _unpacked(bits: Tensor, channels_last: bool, shape: tuple[int, ...]) -> Tensor:
    if not channels_last:
        return unpack_bits(bits, torch.Size(shape))
    n, c, h, w = shape
    return unpack_bits(bits, torch.Size((n, h, w, c))).permute(0, 3, 1, 2)
