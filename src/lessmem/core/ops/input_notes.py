"""Notes that lessmem layers leave on the tensors they return, so that a later layer knows what an
earlier one already keeps for backward: a BatchNorm notes its input or the code of it, a ReLU (ReLU6,
Hardtanh) reading that output unchanged notes it with its own 1-bit mask, and a conv whose map says ``from_bn``
rebuilds its input from both instead of keeping one more copy (``rebuilt_input``).

A note holds for the tensor it was left on and only while that tensor is unchanged (same object,
same version counter: an in-place op between two layers voids it). Its codes and masks are weak
references: a note never keeps one alive; the node that reads one saves it like any other. An exact
BatchNorm's input is read from its node (``saved_input``), which holds it until its backward."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from lessmem.core.storage import Storage, TensorMeta


@dataclass(frozen=True)
class NormCode:
    """What a training-mode BatchNorm keeps: its input (native) or its input's code (x_hat for
    integer codes, x for bf16), the batch statistics, and its affine parameters. The statistics
    are per channel: held, not weakly referenced (a saved output's Python object dies with its
    forward; the node keeps the data)."""

    packed: tuple[Callable[[], Tensor | None], ...]  # weak references, or ``saved_input``
    storage: Storage
    meta: TensorMeta
    normalized: bool  # packed holds x_hat = (x - mean) * invstd, not x
    mean: Tensor
    invstd: Tensor
    weight: Tensor
    bias: Tensor


@dataclass(frozen=True)
class ClampOfNorm:
    """clamp(BatchNorm(x), lo, hi) (ReLU: lo 0, no hi; ReLU6; Hardtanh): the BatchNorm's code and the
    activation's pass mask (``pack_bits`` layout; set where lo < y < hi)."""

    norm: NormCode
    bits: weakref.ref
    channels_last: bool
    lo: float = 0.0
    hi: float | None = None


_notes: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def note(t: Tensor, what: NormCode | ClampOfNorm) -> None:
    """Leave ``what`` on ``t`` (eager only: a compiled graph has no tensor objects to note)."""
    if not torch.compiler.is_compiling():
        _notes[t] = (t._version, what)


def noted(t: Tensor, kind: type):
    """The note of ``kind`` left on ``t``, or None (none left, another kind, or ``t`` changed since)."""
    if torch.compiler.is_compiling():
        return None
    entry = _notes.get(t)
    if entry is None or entry[0] != t._version or not isinstance(entry[1], kind):
        return None
    return entry[1]


def refs(*tensors: Tensor) -> tuple[weakref.ref, ...]:
    return tuple(weakref.ref(t) for t in tensors)


def saved_input(node) -> Callable[[], Tensor | None]:
    """The input a stock BatchNorm's node saved, read from the node when called (a weak reference's
    form): a reference to the tensor would die under saved-tensor hooks (the node may keep another
    tensor object of its storage) or keep it past the node's backward (a ReLU marking its output
    dirty keeps that output, and so its note, to the end of backward); the node releases it there."""
    def read() -> Tensor | None:
        try:
            return node._saved_input
        except RuntimeError:  # released by its backward
            return None
    return read
