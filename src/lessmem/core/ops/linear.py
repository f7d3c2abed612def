"""Linear on (..., tokens, features) that saves its input only as means over groups of k tokens:
the autograd Function, the swapped-in ``CompressedLinear``, and ``CompressedTransposedLinear`` for
HF transformers' ``Conv1D`` (GPT-2's projections: a linear whose weight is stored (in, out),
y = x @ W + b)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core.ops.dispatch import autocast_cast, kept_by_graph, needs_saving, warn_eager
from lessmem.core.ops.pooling import (
    expand_tokens,
    pool_tokens,
    pooled_tokens_once,
    save_pooled_input,
    saved_pooled_input,
)
from lessmem.core.spec import LayerSpec
from lessmem.core.storage import pack_tensor


def linear_grads(grad_out, x_hat, weight, needs):
    """(input, weight, bias) gradients of linear on (..., tokens, features), the weight gradient
    taken on ``x_hat`` (None when not needed); ``needs`` says which to compute."""
    flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
    gx = grad_out @ weight if needs[0] else None
    gw = flat_grad.t() @ x_hat.reshape(-1, x_hat.shape[-1]) if needs[1] else None
    gb = flat_grad.sum(0) if needs[2] else None
    return gx, gw, gb


class PooledLinearFunction(torch.autograd.Function):
    """linear whose input (..., tokens, features) is saved as means over groups of k tokens."""

    @staticmethod
    def forward(ctx, x, weight, bias, k, storage):
        out = F.linear(x, weight, bias)
        packed = pooled_tokens_once(x, k, storage) if ctx.needs_input_grad[1] else None
        save_pooled_input(ctx, x, weight, bias, packed, storage)
        ctx.k = k
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, pooled, shape, needs = saved_pooled_input(ctx)
        x_hat = expand_tokens(pooled, ctx.k, shape[-2]) if pooled is not None else None
        return (*linear_grads(grad_out, x_hat, weight, needs), None, None)


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


class CompressedTransposedLinear(nn.Module):
    """Swapped in for ``transformers.pytorch_utils.Conv1D`` (matched by name: the core does not
    import transformers); it keeps that class's ``weight`` (in, out), ``bias`` and ``nf``."""

    lessmem_spec: LayerSpec
    weight: nn.Parameter
    bias: nn.Parameter
    nf: int

    def forward(self, x: Tensor) -> Tensor:
        if keeps_stock_path(self, x):  # Conv1D's own forward, bit for bit
            out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
            return out.view(*x.shape[:-1], self.nf)
        return token_pooled_linear(self, x, self.weight.t(), self.bias)
