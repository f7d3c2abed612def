"""Linear on (..., tokens, features) that saves its input pooled over groups of k tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core.functions.kept_input import kept_by_graph
from lessmem.core.functions.linear import PooledLinearFunction
from lessmem.core.functions.pooling import pool_tokens
from lessmem.core.layers.dispatch import autocast_cast, needs_saving, warn_eager
from lessmem.core.spec import LayerSpec
from lessmem.core.storage import pack_tensor

# int8 storage has no compiled kernel: it runs eagerly under torch.compile (a graph break).
_eager_linear = torch.compiler.disable(PooledLinearFunction.apply)


def keeps_stock_path(layer: nn.Module, x: Tensor) -> bool:
    """Whether ``layer`` should run its stock linear: nothing will be saved, the input has no token
    dim, or autograd keeps ``x`` full-size anyway (a reference then costs 0 bytes, a pooled copy
    would add its own; not checked while compiling, where the graph is not built yet)."""
    if x.dim() < 3 or not needs_saving(x, layer):
        return True
    return not torch.compiler.is_compiling() and kept_by_graph(x)


def token_pooled_linear(layer: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` keeping ``x`` as means over ``layer.lessmem_spec`` token groups."""
    x, w, b = autocast_cast(x, weight, bias)
    spec: LayerSpec = layer.lessmem_spec
    k, storage = spec.kernel[0], spec.storage
    if torch.compiler.is_compiling():
        if storage not in ("native", "bf16"):
            warn_eager(layer, f"{storage} storage")
            return _eager_linear(x, w, b, k, storage)
        pooled = pack_tensor(pool_tokens(x.detach(), k), storage)[0]
        return torch.ops.lessmem.linear_keep_pooled(x, pooled, w, b, k)
    with torch.autocast(x.device.type, enabled=False):
        return PooledLinearFunction.apply(x, w, b, k, storage)


class CompressedLinear(nn.Linear):
    """Linear on (..., tokens, features) that saves its input pooled over groups of k tokens."""

    lessmem_spec: LayerSpec

    def forward(self, x: Tensor) -> Tensor:
        if keeps_stock_path(self, x):
            return F.linear(x, self.weight, self.bias)
        return token_pooled_linear(self, x, self.weight, self.bias)
