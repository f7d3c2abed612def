"""Linear on (..., tokens, features) that saves its input pooled over groups of k tokens."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lessmem.core.functions.linear import PooledLinearFunction
from lessmem.core.functions.pooling import pool_tokens
from lessmem.core.layers.dispatch import autocast_cast, needs_saving, warn_eager
from lessmem.core.spec import LayerSpec
from lessmem.core.storage import pack_tensor

# int8 storage has no compiled kernel: it runs eagerly under torch.compile (a graph break).
_eager_linear = torch.compiler.disable(PooledLinearFunction.apply)


class CompressedLinear(nn.Linear):
    """Linear on (..., tokens, features) that saves its input pooled over groups of k tokens."""

    lessmem_spec: LayerSpec

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 3 or not needs_saving(x, self):
            return super().forward(x)
        x, w, b = autocast_cast(x, self.weight, self.bias)
        k, storage = self.lessmem_spec.kernel[0], self.lessmem_spec.storage
        if torch.compiler.is_compiling():
            if storage == "int8":
                warn_eager(self, "int8 storage")
                return _eager_linear(x, w, b, k, storage)
            pooled = pack_tensor(pool_tokens(x.detach(), k), storage)[0]
            return torch.ops.lessmem.linear_keep_pooled(x, pooled, w, b, k)
        with torch.autocast(x.device.type, enabled=False):
            return PooledLinearFunction.apply(x, w, b, k, storage)
