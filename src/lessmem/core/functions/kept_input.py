"""Whether autograd already keeps a tensor's storage for backward, so that a layer reading it can
hold a reference (0 added bytes, exact gradient) instead of storing a pooled copy.

The check looks at the nodes that produced the tensor: a node upstream of a layer runs its backward
after the layer's, so a storage one of them saved stays alive through the layer's backward anyway.
Typical case: attention's output, saved full-size by scaled_dot_product_attention, reshaped into
the output projection's input."""

from __future__ import annotations

from torch import Tensor

# Producer nodes looked at, nearest first: enough to pass the views between an op and the layer
# (attention: transpose, reshape, view) without walking a whole graph on every forward.
NODES_LOOKED_AT = 6


def kept_by_graph(x: Tensor) -> bool:
    """Whether a node among the nearest producers of ``x`` saved a tensor sharing its storage."""
    if x.grad_fn is None:
        return False
    storage = x.untyped_storage().data_ptr()
    if storage == 0:  # no elements: nothing to keep
        return False
    queue, seen = [x.grad_fn], set()
    while queue and len(seen) < NODES_LOOKED_AT:
        node = queue.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if any(t.untyped_storage().data_ptr() == storage for t in _saved_tensors(node)):
            return True
        queue.extend(parent for parent, _ in node.next_functions)
    return False


def _saved_tensors(node) -> list[Tensor]:
    """What ``node`` saved for backward: the ``_saved_*`` tensors (and tensor lists) of a built-in
    op, or a custom Function's ``saved_tensors``."""
    saved: list[object] = [getattr(node, n) for n in dir(node) if n.startswith("_saved_")]
    saved.extend(getattr(node, "saved_tensors", None) or ())
    flat = [t for s in saved for t in (s if isinstance(s, (list, tuple)) else (s,))]
    return [t for t in flat if isinstance(t, Tensor)]
