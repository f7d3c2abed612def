"""timm / HF transformers layer classes whose math lessmem knows, matched by qualified class name
(the core imports neither library). The forwards were read at timm 1.0 and transformers 4.40 to 5.x;
where an instance can compute something else (an option picked at construction) a predicate
checks it, and an instance that fails it is left alone: swapping it would change the model."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.nn.functional as F
from torch import nn

from lessmem.core.layers.activations import (
    StoredFunctionalGELU,
    StoredFunctionalGELUTanh,
    StoredFunctionalSiLU,
)
from lessmem.core.layers.recomputed import (
    RecomputedActivation,
    RecomputedGatedMLP,
    RecomputedRMSNorm,
    SlicedSDPAttention,
)
from lessmem.core.layers.transposed_linear import CompressedTransposedLinear

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
