"""Which stock layer ``compress`` swaps for which lessmem layer, and back.

Only layers whose math is known are swapped: these exact types, nn.Linear subclasses that keep
Linear's forward, and timm / HF classes matched by name. A user subclass may override forward,
and silently replacing that would change the model."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from lessmem.core.ops.attention import CompressedMultiheadAttention
from lessmem.core.ops.batchnorm import NotedBatchNorm2d, StoredBatchNorm2d
from lessmem.core.ops.conv import CompressedConv2d
from lessmem.core.ops.dropout import PackedDropout
from lessmem.core.ops.linear import CompressedLinear, CompressedTransposedLinear
from lessmem.core.ops.masked_activations import PackedHardtanh, PackedReLU, PackedReLU6
from lessmem.core.ops.maxpool import CompactMaxPool2d
from lessmem.core.ops.recompute import (
    RecomputedActivation,
    RecomputedGatedMLP,
    RecomputedRMSNorm,
    SlicedSDPAttention,
)
from lessmem.core.ops.stored_activations import (
    StoredFunctionalGELU,
    StoredFunctionalGELUTanh,
    StoredFunctionalSiLU,
    StoredGELU,
    StoredSiLU,
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
# Exact, where a map rebuilds conv inputs (``from_bn``): the BatchNorms left exact note what they keep.
NOTED_NORMS: dict[type[nn.Module], type[nn.Module]] = {nn.BatchNorm2d: NotedBatchNorm2d}
STORED_ACTIVATIONS: dict[type[nn.Module], type[nn.Module]] = {
    nn.GELU: StoredGELU,
    nn.SiLU: StoredSiLU,
}
STOCK_OF: dict[type[nn.Module], type[nn.Module]] = {
    v: k for k, v in {**COMPRESSIBLE, **EXACT_COMPANIONS, **STORED_NORMS, **NOTED_NORMS, **STORED_ACTIVATIONS}.items()
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


# timm / HF transformers layer classes whose math lessmem knows, matched by qualified class name
# (the core imports neither library). The forwards were read at timm 1.0 and transformers 4.40 to 5.x;
# where an instance can compute something else (an option picked at construction) a predicate
# checks it, and an instance that fails it is left alone: swapping it would change the model.

# nn.Linear subclasses whose forward is F.linear(x, weight, bias) (timm's only adds a TorchScript cast).
LINEAR_SUBCLASSES = {"timm.layers.linear.Linear"}
# Linears with weight (in, out): y = x @ W + b.
TRANSPOSED_LINEARS = {"transformers.pytorch_utils.Conv1D": CompressedTransposedLinear}


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _calls(act: object, fn: object, **keywords: str) -> bool:
    """Whether HF's ``self.act`` is ``fn`` (or ``functools.partial(fn, **keywords)``)."""
    if keywords:
        return isinstance(act, functools.partial) and act.func is fn and act.keywords == keywords
    return act is fn


# Activation class -> (its stored version, whether this instance's forward is that function).
FUNCTIONAL_ACTIVATIONS = {
    "timm.layers.activations.GELU": (StoredFunctionalGELU, lambda m: True),
    "timm.layers.activations.GELUTanh": (StoredFunctionalGELUTanh, lambda m: True),
    # HF picks self.act at construction: F.gelu, or a Python formula (not bit-identical) when asked.
    "transformers.activations.GELUActivation": (StoredFunctionalGELU, lambda m: _calls(m.act, F.gelu)),
    "transformers.activations.GELUTanh": (
        StoredFunctionalGELUTanh,
        lambda m: _calls(m.act, F.gelu, approximate="tanh"),
    ),
    "transformers.activations.SiLUActivation": (StoredFunctionalSiLU, lambda m: True),
}

# Exact companions: pure formulas of several ops, recomputed in backward from their inputs.
RECOMPUTED = {
    "transformers.activations.NewGELUActivation": (RecomputedActivation, lambda m: True),  # GPT-2's
    "transformers.activations.FastGELUActivation": (RecomputedActivation, lambda m: True),
    "transformers.activations.QuickGELUActivation": (RecomputedActivation, lambda m: True),
    "transformers.activations.AccurateGELUActivation": (RecomputedActivation, lambda m: True),
    # transformers < 4.45 slices the projections when pretraining_tp > 1 (other sums, other bits).
    "transformers.models.llama.modeling_llama.LlamaMLP": (
        RecomputedGatedMLP,
        lambda m: getattr(m.config, "pretraining_tp", 1) == 1,
    ),
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": (RecomputedRMSNorm, lambda m: True),
    # Its SDPA call, where saved tensors are lossy (otherwise the stock call runs).
    "transformers.models.llama.modeling_llama.LlamaAttention": (SlicedSDPAttention, lambda m: True),
}


def zoo_compressed_class(module: nn.Module) -> type[nn.Module] | None:
    """The pooled-token class for a timm / HF linear, or None when ``module`` is not one."""
    return TRANSPOSED_LINEARS.get(qualified_name(type(module)))


def zoo_stored_activation(module: nn.Module) -> type[nn.Module] | None:
    """The stored-input class for a timm / HF GELU / SiLU module, or None."""
    return _checked(FUNCTIONAL_ACTIVATIONS, module)


def zoo_exact_companion(module: nn.Module) -> type[nn.Module] | None:
    """The recomputing companion of a timm / HF module, or None."""
    return _checked(RECOMPUTED, module)


def _checked(known: dict[str, tuple[type[nn.Module], Callable[[nn.Module], bool]]],
             module: nn.Module) -> type[nn.Module] | None:
    """``module``'s swap in ``known`` (class name -> (class, predicate)) when its predicate holds."""
    entry = known.get(qualified_name(type(module)))
    return entry[0] if entry is not None and entry[1](module) else None
