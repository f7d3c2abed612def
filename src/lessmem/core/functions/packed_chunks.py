"""Decode a batch slice of a tensor packed by ``storage.pack_tensor``, so backward can walk a
packed activation a few samples at a time instead of decoding a full-size copy."""

from __future__ import annotations

from torch import Tensor

from lessmem.core.storage import BITS, GROUP, Storage, TensorMeta, unpack_tensor


def sliceable(meta: TensorMeta, storage: Storage) -> bool:
    """Whether samples start on a group boundary (groups run over memory order, sample-major in
    both NCHW and NHWC), so a slice of samples is a slice of the packed tensors."""
    per_sample = 1
    for s in meta.shape[1:]:
        per_sample *= s
    return storage in ("native", "bf16") or (len(meta.shape) > 1 and per_sample % GROUP == 0)


def unpack_samples(packed: tuple[Tensor, ...] | list[Tensor], storage: Storage, meta: TensorMeta,
                   start: int, stop: int) -> Tensor:
    """Samples ``start:stop`` of the tensor ``packed`` stands for (``sliceable`` must hold)."""
    if storage in ("native", "bf16"):
        return unpack_tensor((packed[0][start:stop],), storage, meta)
    codes, lo, scale = packed
    groups = lo.numel() // meta.shape[0]
    per_byte = 8 // BITS[storage]
    g0, g1 = start * groups, stop * groups
    part = (codes[g0 * GROUP // per_byte: g1 * GROUP // per_byte], lo[g0:g1], scale[g0:g1])
    return unpack_tensor(part, storage, meta._replace(shape=(stop - start, *meta.shape[1:])))
