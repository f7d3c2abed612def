"""A conv input rebuilt in backward instead of kept (a map's ``from_bn``): where a conv reads
y = ReLU(BatchNorm(x)) and the BatchNorm keeps a code of its input (``norm_storage``) and the ReLU
its 1-bit mask, y = mask * (gamma * x_hat + beta) is already determined by what those two keep,
so the conv keeps nothing of its own. Its weight gradient is then as approximate as the
BatchNorm's code: on a trained resnet20 (bn1 -> relu -> conv2 of every block, batch 32) the
rebuilt input's squared error relative to y is 0.43 from int2 BatchNorm codes and 0.017 from
int4 ones, where an int2 code of y itself gives 0.12 and int1 1.0. Input gradients stay exact.
The layers find each other through ``input_notes``."""

from __future__ import annotations

import torch
from torch import Tensor

from lessmem.core.ops.input_notes import ReluOfNorm, noted
from lessmem.core.ops.masked_activations import unpack_bits
from lessmem.core.spec import FROM_NORM
from lessmem.core.storage import sliceable, unpack_samples, unpack_tensor


def claim(x: Tensor, layer: str) -> tuple[ReluOfNorm, tuple[Tensor, ...]]:
    """The note on the conv input ``x`` and the tensors it names, alive (bits, mean, invstd,
    BatchNorm weight and bias, code...), or a clear error."""
    source = noted(x, ReluOfNorm)
    if source is None:
        raise ValueError(
            f"layer {layer!r}: storage {FROM_NORM!r} rebuilds the conv input from the BatchNorm and ReLU "
            "right before it, but this input is not a lessmem ReLU's output of a BatchNorm that keeps a "
            "code (give that BatchNorm a lossy norm_storage, keep exact_companions on, and pass the ReLU's "
            "output to the conv unchanged), or the conv runs under torch.compile (from_bn is eager only)")
    norm = source.norm
    tensors = tuple(r() for r in (source.bits, norm.mean, norm.invstd, *norm.packed))
    if any(t is None for t in tensors):
        raise ValueError(f"layer {layer!r}: the BatchNorm / ReLU before it keep no codes to rebuild from "
                         f"(gradient checkpointing drops saved tensors: {FROM_NORM!r} does not combine with it)")
    return source, (*tensors[:3], norm.weight, norm.bias, *tensors[3:])


def rebuilt_samples(source: ReluOfNorm, saved: tuple[Tensor, ...], shape: tuple[int, ...], start: int,
                    stop: int) -> Tensor:
    """Samples ``start:stop`` of the conv input, from ``claim``'s tensors."""
    bits, mean, invstd, weight, bias, *packed = saved
    norm = source.norm
    n = stop - start
    meta = norm.meta
    if sliceable(meta, norm.storage):
        x = unpack_samples(packed, norm.storage, meta, start, stop)
    else:
        x = unpack_tensor(packed, norm.storage, meta)[start:stop]
    chan = (1, -1, 1, 1)
    x_hat = x.float() if norm.normalized else (x.float() - mean.view(chan)).mul_(invstd.view(chan))
    y = x_hat.mul_(weight.view(chan)).add_(bias.view(chan))
    return y.mul_(_mask_samples(bits, source.channels_last, shape, start, n)).to(meta.dtype)


def _mask_samples(bits: Tensor, channels_last: bool, shape: tuple[int, ...], start: int, n: int) -> Tensor:
    per_sample = shape[1] * shape[2] * shape[3]
    if per_sample % 8:  # samples do not start on a byte: unpack all, slice
        whole = _unpacked(bits, channels_last, (shape[0], *shape[1:]))
        return whole[start: start + n]
    part = bits[start * per_sample // 8: (start + n) * per_sample // 8]
    return _unpacked(part, channels_last, (n, *shape[1:]))


def _unpacked(bits: Tensor, channels_last: bool, shape: tuple[int, ...]) -> Tensor:
    if not channels_last:
        return unpack_bits(bits, torch.Size(shape))
    n, c, h, w = shape
    return unpack_bits(bits, torch.Size((n, h, w, c))).permute(0, 3, 1, 2)
