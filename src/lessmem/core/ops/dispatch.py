"""How a swapped layer's forward picks its path: stock when nothing will be saved or autograd keeps
its input anyway (``kept_by_graph``), one dtype as autocast would choose it, and eager (with one
warning) where torch.compile has no kernel."""

from __future__ import annotations

import re
import warnings

import torch
from torch import Tensor, nn

_warned: set[str] = set()
# Where ``compress`` keeps a swapped module's own class (``uncompress`` restores it).
ORIGINAL_CLASS_ATTR = "_lessmem_original_class"


def needs_saving(x: Tensor, module: nn.Module) -> bool:
    """Whether autograd will keep anything: under no_grad / inference the stock path runs, no overhead."""
    return torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for p in module.parameters(recurse=False))
    )


def autocast_cast(x: Tensor, weight: Tensor, bias: Tensor | None):
    """Cast like autocast would for conv/linear, so the Function then runs in a single dtype."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def warn_eager(module: nn.Module, what: str) -> None:
    """Say once per layer that a part without a compiled kernel runs eagerly (a graph break)."""
    name = getattr(module, "lessmem_name", type(module).__name__)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"lessmem: layer {name!r} ({what}) has no compiled kernel on torch "
            f"{torch.__version__}; it runs eagerly under torch.compile (graph break)",
            stacklevel=3,
        )


# Whether autograd already keeps a tensor's storage for backward, so that a layer reading it can
# hold a reference (0 added bytes, exact gradient) instead of storing a pooled copy.
#
# Decided from the graph's structure, not from the saved tensors' values: ``x`` is reached from its
# producing op through view ops only, and that op saves its own output (``result`` / ``output``).
# Typical case: attention's output, which scaled_dot_product_attention saves, transposed and
# reshaped into the output projection. The producer runs its backward after the layer's, so its
# saved output stays alive through the layer's backward anyway. Reading no saved tensor keeps the
# answer the same under saved-tensor hooks (checkpointing recomputes the forward and must take the
# same path; a byte count's hooks must see the path a plain run takes).

# Ops whose output is a view of their first input (autograd node names without "Backward<n>").
VIEW_OPS = frozenset({
    "Alias", "AsStrided", "Diagonal", "Expand", "Narrow", "Permute", "ReshapeAlias", "Select", "Slice",
    "Split", "SplitWithSizes", "Squeeze", "T", "Transpose", "Unbind", "Unfold", "UnsafeView", "Unsqueeze",
    "View",
})
# How autograd nodes name a saved output of their op.
SAVED_OUTPUTS = ("_raw_saved_result", "_raw_saved_output")
# Views passed before giving up: attention's output reaches its projection through three.
MAX_VIEWS = 8


def kept_by_graph(x: Tensor) -> bool:
    """Whether ``x`` is (a view of) an output its producing op saves for backward."""
    node = x.grad_fn
    for _ in range(MAX_VIEWS + 1):
        if node is None:
            return False
        if any(hasattr(node, name) for name in SAVED_OUTPUTS):
            return True
        if _op_name(node) not in VIEW_OPS or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


def _op_name(node: object) -> str:
    match = re.fullmatch(r"(\w+?)Backward\d*", type(node).__name__)
    return match.group(1) if match else ""
