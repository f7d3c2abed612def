"""Which stock layer ``compress`` swaps for which lessmem layer, and back.

Only layers whose math is known are swapped: these exact types, nn.Linear subclasses that keep
Linear's forward, and the timm / HF classes of ``zoo_classes``. A user subclass may override
forward, and silently replacing that would change the model."""

from __future__ import annotations

from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

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
from lessmem.core.layers.transposed_linear import CompressedTransposedLinear
from lessmem.core.layers.zoo_classes import (
    LINEAR_SUBCLASSES,
    qualified_name,
    zoo_compressed_class,
    zoo_exact_companion,
    zoo_stored_activation,
)

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

COMPRESSED_CLASSES = (*COMPRESSIBLE.values(), CompressedTransposedLinear)


def compressed_class_of(module: nn.Module) -> type[nn.Module] | None:
    """The class a pooling spec swaps ``module`` to, or None when its math is not known."""
    kind = type(module)
    if kind in COMPRESSIBLE:
        return COMPRESSIBLE[kind]
    if _is_plain_linear(module):
        return CompressedLinear
    return zoo_compressed_class(module)


def pools_tokens(module: nn.Module) -> bool:
    """Whether a pooling spec makes ``module`` keep its input as means over token groups (a
    linear whose math is known, stock or already compressed), rather than spatial blocks."""
    kind = type(module) if type(module) in COMPRESSED_CLASSES else compressed_class_of(module)
    return kind in (CompressedLinear, CompressedTransposedLinear)


def _is_plain_linear(module: nn.Module) -> bool:
    # MultiheadAttention's out_proj is never called (the attention reads its weight directly);
    # the swapped attention already covers it.
    kind = type(module)
    if not isinstance(module, nn.Linear) or kind is NonDynamicallyQuantizableLinear:
        return False
    return kind.forward is nn.Linear.forward or qualified_name(kind) in LINEAR_SUBCLASSES


def stored_activation_of(module: nn.Module) -> type[nn.Module] | None:
    """The class ``act_storage`` swaps ``module`` to, or None when it is no GELU / SiLU."""
    return STORED_ACTIVATIONS.get(type(module)) or zoo_stored_activation(module)


def exact_companion_of(module: nn.Module) -> type[nn.Module] | None:
    """The exact companion ``compress`` swaps ``module`` to, or None."""
    return EXACT_COMPANIONS.get(type(module)) or zoo_exact_companion(module)
