"""A decoded image dataset held in memory as uint8 tensors, and its batched augmentation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TensorImages:
    """Images (N, 3, H, W) uint8 and labels (N,) int64, kept on the CPU."""

    images: Tensor
    labels: Tensor
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)

    def rows(self, idx: Tensor) -> TensorImages:
        """The samples at ``idx``, in that order."""
        return TensorImages(self.images[idx], self.labels[idx], self.classes)


@dataclass(frozen=True)
class CropFlip:
    """The random numbers of one batch's crop offsets and flips (drawn for ``n`` images)."""

    oy: Tensor | None
    ox: Tensor | None
    flip: Tensor

    @staticmethod
    def draw(g: torch.Generator, n: int, pad: int) -> CropFlip:
        oy = torch.randint(0, 2 * pad + 1, (n,), generator=g) if pad > 0 else None
        ox = torch.randint(0, 2 * pad + 1, (n,), generator=g) if pad > 0 else None
        return CropFlip(oy, ox, torch.rand(n, generator=g) < 0.5)

    def apply(self, x: Tensor, pad: int, rows_of: slice | None = None) -> Tensor:
        """Random crop after zero-padding by ``pad`` and random horizontal flip of ``x``, which may
        be rows ``rows_of`` of the drawn batch (one rank's shard: the shards of N ranks together
        equal one process's batch)."""
        pick = slice(None) if rows_of is None else rows_of
        _, _, h, w = x.shape
        if self.oy is not None and self.ox is not None:
            padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
            rows = (self.oy[pick][:, None] + torch.arange(h))[:, None, :, None]  # (n,1,h,1)
            cols = (self.ox[pick][:, None] + torch.arange(w))[:, None, None, :]  # (n,1,1,w)
            x = padded[torch.arange(len(x))[:, None, None, None], torch.arange(x.shape[1])[None, :, None, None],
                       rows, cols]
        return torch.where(self.flip[pick][:, None, None, None], x.flip(3), x)
