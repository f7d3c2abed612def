"""Saved-tensor regions: the menu's items for what a module's own forward saves (a norm's input,
attention's q / k / v / output, a gated product), stored by ``compress(saved_storage=...)``.

A region is one module with its children shielded (``native``), so it covers the tensors saved by
the module's own code and nothing a child saves: the children are items of their own (linears,
activations, other regions) and their bytes stay additive. ``region_rule`` writes the
``saved_storage`` rule of a choice of regions; the exact names come before every shield, so a
chosen region nested in another keeps its own storage (first matching pattern wins)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lessmem.core.memory import graph_free


def region_rule(choices: Mapping[str, str], model_or_children: nn.Module | Mapping[str, bool]) -> dict[str, str] | str:
    """The ``saved_storage`` rule storing each region of ``choices`` (name -> storage; ``native``
    entries are left out) and nothing else; ``model_or_children``: the model, or name -> whether
    that module has children (a shield pattern must match some module). ``"native"`` when nothing
    is lossy."""
    lossy = {name: s for name, s in choices.items() if s != "native"}
    if not lossy:
        return "native"
    if isinstance(model_or_children, nn.Module):
        has_children = {n: any(True for _ in model_or_children.get_submodule(n).children()) for n in lossy}
    else:
        has_children = dict(model_or_children)
    return lossy | {f"{name}.*": "native" for name in lossy if has_children.get(name, False)}


def region_candidates(model: nn.Module, own_bytes: Mapping[str, int], items: set[str]) -> list[str]:
    """Modules (not the model itself) whose own forward saved bytes (``own_bytes``: measure_memory's
    per-layer count) and which are no other item, in module order."""
    return [name for name, _ in model.named_modules() if name and own_bytes.get(name, 0) > 0 and name not in items]


def region_groups(model: nn.Module, x: Tensor, names: list[str]) -> list[list[str]]:
    """``names`` in groups that save one tensor between them (Llama's rotary tables, made once and
    saved by every attention): one lossy copy serves them all, so their bytes add up only when
    they choose together. Each group in module order; singletons for the rest."""
    wanted = set(names)
    held = {_key(t) for t in itertools.chain(model.parameters(), model.buffers(), [x])}
    stack: list[str] = [""]
    savers: dict[tuple[str, int], set[str]] = {}

    def pack(t: Tensor) -> Tensor:
        if t.is_floating_point() and t.layout == torch.strided and _key(t) not in held and stack[-1] in wanted:
            savers.setdefault(_key(t), set()).add(stack[-1])
        return graph_free(t)

    def leave(module: nn.Module, args: object, output: object) -> None:
        stack.pop()  # a hook's non-None return would replace the output

    handles = [h for name, m in model.named_modules()
               for h in (m.register_forward_pre_hook(lambda mod, args, n=name: stack.append(n)),
                         m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        del out
    finally:
        for h in handles:
            h.remove()
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            n = parent[n]
        return n

    for group in savers.values():
        first, *rest = sorted(group, key=names.index)
        for n in rest:
            parent[root(n)] = root(first)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(root(n), []).append(n)
    return list(groups.values())


def _key(t: Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()
