"""GELU / SiLU (torch's, and timm / HF classes computing the same) with a bf16 or int8 copy of
their input (approximate, opt-in): the autograd Function and the swapped-in layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core.ops.dispatch import needs_saving
from lessmem.core.storage import Storage, pack_tensor, tensor_meta, unpack_tensor


class StoredActivationFunction(torch.autograd.Function):
    """GELU or SiLU that keeps its input as bf16 or 8-bit per-feature codes.

    Approximate: the derivative is evaluated at the dequantized input, so the input gradient is
    no longer exact. Opt-in through ``compress(..., act_storage=...)``.
    """

    @staticmethod
    def forward(ctx, x, kind, approximate, storage):
        out = F.gelu(x, approximate=approximate) if kind == "gelu" else F.silu(x)
        ctx.save_for_backward(*pack_tensor(x.detach(), storage))
        ctx.kind, ctx.approximate, ctx.storage, ctx.meta = kind, approximate, storage, tensor_meta(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        x = unpack_tensor(ctx.saved_tensors, ctx.storage, ctx.meta)
        if ctx.kind == "gelu":
            gx = torch.ops.aten.gelu_backward(grad, x, approximate=ctx.approximate)
        else:
            gx = torch.ops.aten.silu_backward(grad, x)
        return gx, None, None, None


class StoredGELU(nn.GELU):
    """GELU keeping its input in ``lessmem_storage`` (bf16 / int8) — approximate."""

    lessmem_storage: Storage

    def forward(self, x: Tensor) -> Tensor:
        if not needs_saving(x, self):
            return super().forward(x)
        return StoredActivationFunction.apply(x, "gelu", self.approximate, self.lessmem_storage)


class StoredSiLU(nn.SiLU):
    """SiLU keeping its input in ``lessmem_storage`` (bf16 / int8) — approximate."""

    lessmem_storage: Storage

    def forward(self, x: Tensor) -> Tensor:
        if not needs_saving(x, self) or self.inplace:
            return super().forward(x)
        return StoredActivationFunction.apply(x, "silu", "none", self.lessmem_storage)


class StoredFunctionalActivation(nn.Module):
    """A timm / HF activation module whose forward is ``F.gelu`` or ``F.silu`` (matched by class
    name in the registry), keeping its input in ``lessmem_storage`` — approximate."""

    lessmem_storage: Storage
    kind: str
    approximate: str = "none"

    def forward(self, x: Tensor) -> Tensor:
        if not needs_saving(x, self):
            return F.gelu(x, approximate=self.approximate) if self.kind == "gelu" else F.silu(x)
        return StoredActivationFunction.apply(x, self.kind, self.approximate, self.lessmem_storage)


class StoredFunctionalGELU(StoredFunctionalActivation):
    kind = "gelu"


class StoredFunctionalGELUTanh(StoredFunctionalActivation):
    kind, approximate = "gelu", "tanh"


class StoredFunctionalSiLU(StoredFunctionalActivation):
    kind = "silu"
