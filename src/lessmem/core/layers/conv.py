"""Conv2d that saves its input pooled k×k for the weight gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core.functions.conv import PooledConv2dFunction
from lessmem.core.layers.dispatch import autocast_cast, needs_saving, warn_eager
from lessmem.core.spec import LayerSpec

# int8 storage has no compiled kernel: it runs eagerly under torch.compile (a graph break).
_eager_conv = torch.compiler.disable(PooledConv2dFunction.apply)


class CompressedConv2d(nn.Conv2d):
    """Conv2d that saves its input pooled by ``lessmem_spec.kernel`` for the weight gradient."""

    lessmem_spec: LayerSpec

    def forward(self, x: Tensor) -> Tensor:
        if not needs_saving(x, self):
            return super().forward(x)
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        elif isinstance(padding, str):
            x, padding = _explicit_padding(x, padding, self.kernel_size, self.dilation)
        x, w, b = autocast_cast(x, self.weight, self.bias)
        spec = self.lessmem_spec
        args = (x, w, b, self.stride, padding, self.dilation, self.groups, spec.kernel, spec.storage)
        if torch.compiler.is_compiling():
            if spec.storage not in ("native", "bf16"):
                warn_eager(self, f"{spec.storage} storage")
                return _eager_conv(*args)
            pooled = torch.ops.lessmem.pool_blocks(x.detach(), list(spec.kernel), spec.storage)
            return torch.ops.lessmem.conv2d_keep_pooled(
                x, pooled, w, b, list(self.stride), list(padding), list(self.dilation), self.groups,
                list(spec.kernel),
            )
        with torch.autocast(x.device.type, enabled=False):
            return PooledConv2dFunction.apply(*args)


def _explicit_padding(x: Tensor, mode: str, kernel, dilation) -> tuple[Tensor, tuple[int, int]]:
    """'valid'/'same' as integers; an asymmetric 'same' pads the input first, as PyTorch does."""
    if mode == "valid":
        return x, (0, 0)
    total = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
    left = [t // 2 for t in total]
    if all(t % 2 == 0 for t in total):
        return x, (left[0], left[1])
    x = F.pad(x, [left[1], total[1] - left[1], left[0], total[0] - left[0]])
    return x, (0, 0)
