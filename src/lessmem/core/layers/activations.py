"""Activations that keep less for backward: ReLU / ReLU6 / Hardtanh with a 1-bit mask (exact),
GELU / SiLU (torch's, and timm / HF classes computing the same) with a bf16 or int8 copy of their
input (approximate, opt-in)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core.functions.masks import MaskedActivationFunction
from lessmem.core.functions.stored_activation import StoredActivationFunction
from lessmem.core.layers.dispatch import needs_saving
from lessmem.core.storage import Storage


def _masked_activation(x: Tensor, lo: float, hi: float | None, inplace: bool) -> Tensor:
    if not torch.compiler.is_compiling():
        return MaskedActivationFunction.apply(x, lo, hi, inplace)
    # In-place changes nothing in a compiled (functionalized) graph, and the compiler cannot trace
    # a Function that marks its input dirty. The custom op keeps the partitioner from recomputing
    # the mask (and the BatchNorm before it) in backward.
    if x.dim() == 4:
        return torch.ops.lessmem.clamp_mask(x, lo, hi)[0]
    return MaskedActivationFunction.apply(x, lo, hi, False)


class PackedReLU(nn.ReLU):
    """ReLU that keeps a 1-bit mask for backward instead of its full-size output."""

    def forward(self, x: Tensor) -> Tensor:
        if not needs_saving(x, self):
            return super().forward(x)
        return _masked_activation(x, 0.0, None, self.inplace)


class PackedHardtanh(nn.Hardtanh):
    """Hardtanh / ReLU6 with a 1-bit mask instead of the full-size input."""

    def forward(self, x: Tensor) -> Tensor:
        if not needs_saving(x, self):
            return super().forward(x)
        return _masked_activation(x, self.min_val, self.max_val, self.inplace)


class PackedReLU6(nn.ReLU6, PackedHardtanh):
    pass


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
