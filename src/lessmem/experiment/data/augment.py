"""Batched augmentation of uint8 image tensors."""

from __future__ import annotations

import torch
from torch import Tensor


def random_crop_flip(x: Tensor, pad: int, g: torch.Generator, n: int | None = None,
                     rows_of: slice | None = None) -> Tensor:
    """Per-sample random crop after zero-padding by ``pad`` and random horizontal flip, batched.

    ``x`` may be rows ``rows_of`` of a batch of ``n`` images (one rank's shard): the random numbers
    are drawn for the whole batch, so the shards of N ranks together equal one process's batch."""
    n = len(x) if n is None else n
    pick = slice(None) if rows_of is None else rows_of
    _, _, h, w = x.shape
    if pad > 0:
        padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
        oy = torch.randint(0, 2 * pad + 1, (n,), generator=g)[pick]
        ox = torch.randint(0, 2 * pad + 1, (n,), generator=g)[pick]
        n_x = len(x)
        rows = (oy[:, None] + torch.arange(h))[:, None, :, None]  # (n,1,h,1)
        cols = (ox[:, None] + torch.arange(w))[:, None, None, :]  # (n,1,1,w)
        x = padded[torch.arange(n_x)[:, None, None, None], torch.arange(x.shape[1])[None, :, None, None], rows, cols]
    flip = (torch.rand(n, generator=g) < 0.5)[pick]
    return torch.where(flip[:, None, None, None], x.flip(3), x)
