"""How a compressed tensor is stored: native dtype, bfloat16, or 8-bit affine codes per channel.

Anything but ``"native"`` is lossy; it is the "combine with quantization" direction of the paper.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Storage = Literal["native", "bf16", "int8"]
STORAGES: tuple[str, ...] = ("native", "bf16", "int8")


def check_storage(storage: str) -> Storage:
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r}; choose one of {', '.join(STORAGES)}")
    return storage  # type: ignore[return-value]


def _channel_dims(x: Tensor) -> list[int]:
    # Per-channel ranges: dim 1 for images (N, C, H, W), the feature dim for tokens (..., F).
    channel = 1 if x.dim() == 4 else x.dim() - 1
    return [d for d in range(x.dim()) if d != channel]


def pack_tensor(x: Tensor, storage: Storage) -> tuple[Tensor, ...]:
    if storage == "native":
        return (x,)
    if storage == "bf16":
        return (x.to(torch.bfloat16),)
    dims = _channel_dims(x)
    lo = x.amin(dim=dims, keepdim=True).float()
    scale = (x.amax(dim=dims, keepdim=True).float() - lo).clamp_min(1e-12) / 255.0
    codes = ((x.float() - lo) / scale).round_().clamp_(0, 255).to(torch.uint8)
    return codes, lo, scale


def unpack_tensor(packed: tuple[Tensor, ...] | list[Tensor], storage: Storage, dtype: torch.dtype) -> Tensor:
    if storage == "int8":
        codes, lo, scale = packed
        return (codes.float() * scale + lo).to(dtype)
    return packed[0].to(dtype)
