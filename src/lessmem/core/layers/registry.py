"""Which stock layer ``compress`` swaps for which lessmem layer, and back.

Only these exact types are swapped: a user subclass may override forward, and silently replacing
that would change the model."""

from __future__ import annotations

from torch import nn

from lessmem.core.layers.activations import (
    PackedHardtanh,
    PackedReLU,
    PackedReLU6,
    StoredGELU,
    StoredSiLU,
)
from lessmem.core.layers.attention import CompressedMultiheadAttention
from lessmem.core.layers.conv import CompressedConv2d
from lessmem.core.layers.dropout import PackedDropout
from lessmem.core.layers.linear import CompressedLinear
from lessmem.core.layers.maxpool import CompactMaxPool2d
from lessmem.core.layers.norm import StoredBatchNorm2d

# Layers a compression map addresses: their inputs are pooled for the weight gradient.
COMPRESSIBLE: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv2d: CompressedConv2d,
    nn.Linear: CompressedLinear,
    nn.MultiheadAttention: CompressedMultiheadAttention,
}
# Exact swaps that keep bits or small indices instead of full-size tensors.
EXACT_COMPANIONS: dict[type[nn.Module], type[nn.Module]] = {
    nn.ReLU: PackedReLU,
    nn.ReLU6: PackedReLU6,
    nn.Hardtanh: PackedHardtanh,
    nn.MaxPool2d: CompactMaxPool2d,
    nn.Dropout: PackedDropout,
}
# Lossy, opt-in: inputs kept in a lower-precision storage (``norm_storage`` / ``act_storage``).
STORED_NORMS: dict[type[nn.Module], type[nn.Module]] = {nn.BatchNorm2d: StoredBatchNorm2d}
STORED_ACTIVATIONS: dict[type[nn.Module], type[nn.Module]] = {
    nn.GELU: StoredGELU,
    nn.SiLU: StoredSiLU,
}
STOCK_OF: dict[type[nn.Module], type[nn.Module]] = {
    v: k for k, v in {**COMPRESSIBLE, **EXACT_COMPANIONS, **STORED_NORMS, **STORED_ACTIVATIONS}.items()
}
