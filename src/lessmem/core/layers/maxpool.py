"""MaxPool2d that keeps uint8 in-window argmax positions (exact)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from lessmem.core.functions.maxpool import CompactMaxPool2dFunction
from lessmem.core.layers.dispatch import needs_saving


class CompactMaxPool2d(nn.MaxPool2d):
    """MaxPool2d that keeps uint8 in-window argmax positions, not its input and int64 indices."""

    def forward(self, x: Tensor) -> Tensor:
        kernel, dilation = _pair(self.kernel_size), _pair(self.dilation)
        if (
            not needs_saving(x, self)
            or self.return_indices
            or kernel[0] * kernel[1] > 256
            or x.dim() != 4
        ):
            return super().forward(x)
        stride = _pair(self.stride if self.stride is not None else self.kernel_size)
        return CompactMaxPool2dFunction.apply(
            x, kernel, stride, _pair(self.padding), dilation, self.ceil_mode
        )
