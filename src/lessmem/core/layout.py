"""Memory-layout helpers shared by the torch reference ops and the fused mask kernels."""

from __future__ import annotations

import torch
from torch import Tensor


def is_channels_last(x: Tensor) -> bool:
    """A 4-d tensor laid out NHWC (and not also plain contiguous, as 1-channel ones are)."""
    return x.dim() == 4 and x.shape[1] > 1 and not x.is_contiguous() and x.is_contiguous(
        memory_format=torch.channels_last)


def format_of(t: Tensor) -> torch.memory_format:
    return torch.channels_last if is_channels_last(t) else torch.contiguous_format


def is_dense(t: Tensor) -> bool:
    """Contiguous or channels-last: its elements fill memory without gaps."""
    return t.is_contiguous() or is_channels_last(t)


def flat_memory_order(t: Tensor) -> Tensor:
    """A dense tensor's elements in memory order, as a 1-d view."""
    return t.view(-1) if t.is_contiguous() else t.permute(0, 2, 3, 1).reshape(-1)
