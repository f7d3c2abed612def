"""A decoded image dataset held in memory as uint8 tensors."""

from __future__ import annotations

from dataclasses import dataclass

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
