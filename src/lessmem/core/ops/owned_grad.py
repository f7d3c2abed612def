"""Gradients a lessmem backward made fresh for exactly one autograd node, which that node may
then overwrite in place: a full-size buffer fewer alive in backward.

A producer (an op whose backward allocates its input gradient) hands the gradient to the node
that made its input (``input.grad_fn``, noted in forward); that node is its only reader, as
autograd sums several gradients of one tensor into one buffer before the node runs (in place
into ours, or into a fresh tensor, which then is not marked). A node that passes one gradient
on to several others (an addition's backward) is never a lessmem consumer, so a marked tensor
reaching a consumer other than the node it was handed to is left alone.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

_handed: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def handed_to(grad: Tensor, node) -> Tensor:
    """Mark ``grad`` (fresh, read by no one else) as ``node``'s to overwrite; returns it."""
    if node is not None and grad is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        _handed[grad] = node
    return grad


def owns(ctx, grad: Tensor) -> bool:
    """Whether the backward ``ctx`` may overwrite ``grad`` in place (never in a compiled graph:
    the compiler plans its own buffers)."""
    return (not torch.compiler.is_compiling() and not torch.is_grad_enabled() and not grad.requires_grad
            and grad._base is None and _handed.get(grad) is ctx)


def grad_target(x: Tensor):
    """The node ``x``'s gradient goes to (None for a leaf or a view: their gradients may be read
    elsewhere; None under torch.compile, whose graphs have no per-tensor autograd nodes to hand to)."""
    if torch.compiler.is_compiling():
        return None
    return x.grad_fn if x._base is None else None
