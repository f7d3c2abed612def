"""``saved_storage``: lossy storage for every other full-size tensor autograd saves inside chosen
modules (LayerNorm / RMSNorm inputs, attention's q, k, v and output, elementwise products, ...),
a generic fallback in the spirit of GACT.

A chosen module's forward runs inside ``torch.autograd.graph.saved_tensors_hooks`` (entered by a
forward pre-hook, left by a forward hook that runs even when forward raises). The pack hook stores
a floating tensor of at least ``MIN_ELEMENTS`` elements with ``storage.pack_tensor``; unpack
decodes it. Lossy for anything but ``"native"``: backward then runs on decoded values, so every
gradient upstream of the module becomes approximate (the forward stays exact).

Left alone (handed on unchanged):
- parameters and their views / casts (autocast's copy of a weight);
- the model's inputs and their views, when the model itself is called (the caller holds them:
  a copy would add bytes);
- inside lessmem's own layers, what they made without autograd history (pooled copies, masks,
  packed codes: an autograd Function's forward runs without grad), which is stored already;
- small or non-floating tensors, and bf16 storage of a tensor already 2 bytes wide;
- for b-bit codes, a tensor without autograd history that holds an infinity or NaN (an additive
  attention mask of -inf, which a graph of ``torch.compile`` saves: every tensor such a graph
  saves is without history, so this costs a pass, and a sync on a GPU, per saved tensor there;
  in eager mode only constants are checked). A group of codes cannot hold one: its min or scale
  would be infinite and every decoded value of the group NaN.
Packed too: constants made in forward (dropout masks, rotary tables). Not recognised: a
module's buffers saved as they are (rare, and small in the models measured).

One stored copy per storage: tensors spanning one whole storage saved by several ops (a norm's
input saved by two of its ops; attention's output and the out-projection's reference to it)
share one packed copy of the storage, decoded and viewed again in backward; the first save
decides the storage, and a tensor a ``"native"`` module saved first stays a plain reference.
A tensor covering part of its storage (q, k, v split from one projection) is packed alone where
that is smaller than the storage it would keep (not an expanded mask).

Saved-tensor hooks do not stack (the innermost pushed wins), so each context hands what it keeps
(the packed parts, or the tensor left alone) to the hooks that were active outside the
outermost lessmem context, and takes them back from there: a byte count's hooks
(``measure_memory``, ``coverage``) or checkpointing's see the packed bytes themselves, and a
checkpointed region packs alike when recomputed (copies are shared only under the same outer
hooks). Nested chosen modules: the innermost module's rule wins; ``compress`` hooks only the
modules where the rule changes, lessmem's layers in a lossy region, and the model itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from lessmem.core.memory import byte_range, graph_free, storage_key
from lessmem.core.ops.dispatch import VIEW_OPS
from lessmem.core.storage import (
    BFLOAT16,
    BITS,
    Storage,
    TensorMeta,
    pack_tensor,
    stored_bytes,
    tensor_meta,
    unpack_tensor,
)

MIN_ELEMENTS = 2**12
# Where a module keeps its storage, its hooks' ids and its stack of entered contexts.
HOOK_IDS_ATTR = "_lessmem_saved_storage_hooks"
RULE_ATTR = "_lessmem_saved_storage"
_CONTEXTS_ATTR = "_lessmem_saved_storage_contexts"
# Ops through which a tensor is still its source's data: a view or a dtype cast (autocast's copy of a weight).
_SAME_DATA_OPS = VIEW_OPS | {"ToCopy"}
Hooks = tuple[Callable[[Tensor], Any], Callable[[Any], Tensor]]


@dataclass
class _Stored:
    """One packed copy (of a whole storage, or of a single tensor), as the outer hooks keep it."""

    parts: tuple[Any, ...]
    storage: Storage
    meta: TensorMeta
    outer_unpack: Callable[[Any], Tensor] | None
    decoded: Callable[[], Tensor | None] = field(default=lambda: None)  # weak: shared during one backward

    def decode(self) -> Tensor:
        values = self.decoded()
        if values is None:
            if self.outer_unpack is not None:  # once: checkpointing's hooks unpack a tensor only once
                self.parts = tuple(self.outer_unpack(p) for p in self.parts)
                self.outer_unpack = None
            values = unpack_tensor(self.parts, self.storage, self.meta)
            self.decoded = weakref.ref(values)
        return values


@dataclass
class _View:
    """A saved tensor as a view of a packed whole storage."""

    stored: _Stored
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


# (device, storage address, version, outer hooks) -> (weak base tensor, weak packed copy, or None where a
# native module kept it as it is): saves of the same data share one copy while both are alive.
_shared: dict[tuple[str, int, int, int], tuple[weakref.ref, weakref.ref | None]] = {}
# (device, storage address) of each packed part -> (weak part, storage): how coverage names them.
_parts: dict[tuple[str, int], tuple[weakref.ref, str]] = {}


def packed_storage_of(key: tuple[str, int]) -> str | None:
    """The storage a live packed part at ``key`` (``memory.storage_key``) stands in, or None."""
    entry = _parts.get(key)
    if entry is None:
        return None
    part = entry[0]()
    return entry[1] if part is not None and storage_key(part) == key else None


def note_packed(parts: tuple[Tensor, ...], storage: Storage) -> tuple[Tensor, ...]:
    """Name ``parts``, packed in the saved_storage rule's lossy ``storage`` by one of lessmem's
    Functions (which decodes them itself, a slice at a time), as that rule's for ``coverage``."""
    for p in parts:
        _parts[storage_key(p)] = (weakref.ref(p), storage)
    return parts


def _is_parameter(t: Tensor) -> bool:
    """Whether ``t`` is a parameter, or a view / cast of one (autocast's copy of a weight)."""
    if isinstance(t if t._base is None else t._base, nn.Parameter):
        return True
    node = t.grad_fn
    while node is not None:
        name = type(node).__name__
        if name == "AccumulateGrad":
            return isinstance(node.variable, nn.Parameter)
        if name.split("Backward")[0] not in _SAME_DATA_OPS or not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


class _Hooks:
    """The pack / unpack pair of one entered context; ``outer`` are the hooks it hands on to,
    ``held`` the storages of the model's inputs (the caller holds them: a copy would add bytes),
    ``in_layer`` whether the module is one of lessmem's own layers (what it made without autograd
    history, pooled copies and packed codes, is stored already)."""

    def __init__(self, storage: Storage, outer: Hooks | None, held: frozenset, in_layer: bool) -> None:
        self.storage = storage
        self.outer = outer
        self.held = held
        self.in_layer = in_layer

    def _left_alone(self, t: Tensor) -> bool:
        return (
            not t.is_floating_point()
            or t.layout != torch.strided
            or t.numel() < MIN_ELEMENTS
            or (self.storage in BFLOAT16 and t.element_size() <= 2)
            or (self.in_layer and t.grad_fn is None and not t.requires_grad)
            or storage_key(t) in self.held
            or _is_parameter(t)
            or (self.storage in BITS and t.grad_fn is None and not bool(t.isfinite().all()))
        )

    def _outer_pack(self, t: Tensor) -> Any:
        return graph_free(t) if self.outer is None else self.outer[0](t)  # no leak without backward

    def pack(self, t: Tensor) -> Any:
        if self._left_alone(t):
            return self._outer_pack(t)
        storage = t.untyped_storage()
        whole = storage.nbytes() // t.element_size()
        if t.numel() < whole or byte_range(t) != (0, storage.nbytes()):
            # Part of a storage (the rest may be unset memory), or an expanded view: packed alone
            # where that is smaller than the storage it would otherwise keep.
            smaller = stored_bytes(t.numel(), self.storage, t.element_size()) < storage.nbytes()
            return self._pack(t) if smaller and self.storage != "native" else self._outer_pack(t)
        # Shared only under the same outer hooks: a checkpointed region must save alike when recomputed.
        key = (str(t.device), storage.data_ptr(), t._version, id(self.outer[0]) if self.outer else 0)
        base = t if t._base is None else t._base
        hit = _shared.get(key)
        live = hit is not None and hit[0]() is base
        if live and hit[1] is None:  # kept as it is by a native module: a reference costs nothing more
            return self._outer_pack(t)
        if self.storage == "native":
            if not live:
                _shared[key] = (weakref.ref(base), None)
            return self._outer_pack(t)
        stored = hit[1]() if live else None
        if stored is None:
            with torch.no_grad():
                flat = t.as_strided((whole,), (1,), 0)
            stored = self._pack(flat)
            _shared[key] = (weakref.ref(base), weakref.ref(stored))
        return _View(stored, tuple(t.shape), t.stride(), t.storage_offset())

    def _pack(self, t: Tensor) -> _Stored:
        packed = note_packed(pack_tensor(t.detach(), self.storage), self.storage)
        parts = tuple(self._outer_pack(p) for p in packed)
        return _Stored(parts, self.storage, tensor_meta(t), None if self.outer is None else self.outer[1])

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, _View):
            return packed.stored.decode().as_strided(packed.size, packed.stride, packed.offset)
        if isinstance(packed, _Stored):
            return packed.decode()
        return packed if self.outer is None else self.outer[1](packed)


def enter_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """``attach``'s pre-hook: ``module``'s saved tensors go to its storage until its post-hook.
    Called directly for a call whose pre-hooks torch took before ``attach`` added it (a plan
    applied from the module's own forward pre-hook)."""
    if RULE_ATTR not in module.__dict__:
        return  # detached by a pre-hook earlier in this call (a plan re-applied): its post-hook is gone too
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    ours = getattr(top[0], "__self__", None) if top is not None else None
    outer, held = (ours.outer, ours.held) if isinstance(ours, _Hooks) else (top, frozenset())
    storage, in_layer, is_model = module.__dict__[RULE_ATTR]
    if is_model:
        held = held | {storage_key(t) for t in _tensors((args, kwargs))}
    hooks = _Hooks(storage, outer, held, in_layer)
    context = saved_tensors_hooks(hooks.pack, hooks.unpack)
    context.__enter__()
    module.__dict__.setdefault(_CONTEXTS_ATTR, []).append(context)
    if len(_shared) + len(_parts) > 4096:
        _prune()


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _leave(module: nn.Module, args: object, output: object) -> None:
    module.__dict__[_CONTEXTS_ATTR].pop().__exit__(None, None, None)


def _prune() -> None:
    """Drop entries whose packed copy, source or part is gone."""
    for key in [k for k, (base, stored) in _shared.items() if base() is None or (stored is not None and stored() is None)]:
        del _shared[key]
    for key in [k for k, (part, _) in _parts.items() if part() is None]:
        del _parts[key]


def attach(module: nn.Module, storage: Storage, *, in_layer: bool = False, is_model: bool = False) -> None:
    """Run ``module``'s forward with its saved tensors kept in ``storage`` (``"native"``: unchanged,
    which shields it from an enclosing module's lossy rule). ``in_layer``: the module is one of
    lessmem's own layers; ``is_model``: it is the model called by the user, whose inputs are held."""
    pre = module.register_forward_pre_hook(enter_forward, with_kwargs=True)
    post = module.register_forward_hook(_leave, always_call=True)
    module.__dict__[RULE_ATTR] = (storage, in_layer, is_model)
    module.__dict__[HOOK_IDS_ATTR] = (pre.id, post.id)


def attached(module: nn.Module) -> bool:
    """Whether ``module`` has ``saved_storage`` hooks of its own."""
    return RULE_ATTR in module.__dict__


def detach(module: nn.Module) -> None:
    """Undo ``attach`` (nothing when it was not attached). By hook id, not by handle: a handle of
    a deep-copied module would still point at the original's hook tables."""
    ids = module.__dict__.pop(HOOK_IDS_ATTR, None)
    if ids is not None:
        module._forward_pre_hooks.pop(ids[0], None)
        module._forward_hooks.pop(ids[1], None)
        module._forward_hooks_always_called.pop(ids[1], None)
    module.__dict__.pop(RULE_ATTR, None)
    module.__dict__.pop(_CONTEXTS_ATTR, None)
