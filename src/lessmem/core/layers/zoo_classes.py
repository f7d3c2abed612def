"""timm / HF transformers layer classes whose math lessmem knows, matched by qualified class name
(the core imports neither library). Each is swapped only when its forward is the one read here:
a class that computes something else under the same name would otherwise change the model."""

from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import nn

from lessmem.core.layers.activations import (
    StoredFunctionalGELU,
    StoredFunctionalGELUTanh,
    StoredFunctionalSiLU,
)
from lessmem.core.layers.recomputed import RecomputedActivation, RecomputedGatedMLP
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
    "transformers.activations.NewGELUActivation": RecomputedActivation,  # GPT-2's gelu_new
    "transformers.activations.FastGELUActivation": RecomputedActivation,
    "transformers.activations.QuickGELUActivation": RecomputedActivation,
    "transformers.activations.AccurateGELUActivation": RecomputedActivation,
    "transformers.models.llama.modeling_llama.LlamaMLP": RecomputedGatedMLP,
}


def zoo_compressed_class(module: nn.Module) -> type[nn.Module] | None:
    """The pooled-token class for a timm / HF linear, or None when ``module`` is not one."""
    name = qualified_name(type(module))
    if name in TRANSPOSED_LINEARS:
        return TRANSPOSED_LINEARS[name]
    return None


def zoo_stored_activation(module: nn.Module) -> type[nn.Module] | None:
    """The stored-input class for a timm / HF GELU / SiLU module, or None."""
    known = FUNCTIONAL_ACTIVATIONS.get(qualified_name(type(module)))
    if known is None or not known[1](module):
        return None
    return known[0]


def zoo_exact_companion(module: nn.Module) -> type[nn.Module] | None:
    """The recomputing companion of a timm / HF module, or None."""
    return RECOMPUTED.get(qualified_name(type(module)))
