"""nn.Dropout with a 1-bit keep-mask (exact)."""

from __future__ import annotations

from torch import Tensor, nn

from lessmem.core.functions.dropout import PackedDropoutFunction
from lessmem.core.layers.dispatch import needs_saving


class PackedDropout(nn.Dropout):
    """nn.Dropout that keeps 1 bit per element for backward (exact)."""

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and 0.0 < self.p < 1.0 and not self.inplace and needs_saving(x, self)):
            return super().forward(x)
        return PackedDropoutFunction.apply(x, self.p)
