"""Swap a model's layers for compressed ones in place (``compress``) and back (``uncompress``);
the swapped modules keep their parameters, so ``state_dict`` keys never change."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lessmem.core.mapping import first_match, resolve_mapping, unmatched
from lessmem.core.ops import custom_ops  # noqa: F401  (registers torch.ops.lessmem.*)
from lessmem.core.ops.conv import CompressedConv2d
from lessmem.core.ops.dispatch import ORIGINAL_CLASS_ATTR
from lessmem.core.ops.input_notes import ClampOfNorm, noted
from lessmem.core.ops.recomputed_region import (
    RUN_JOIN,
    RecomputedForward,
    RecomputedRun,
    RunMember,
    in_regions,
)
from lessmem.core.ops.registry import (
    NOTED_NORMS,
    STOCK_OF,
    STORED_NORMS,
    compressed_class_of,
    exact_companion_of,
    stored_activation_of,
)
from lessmem.core.plan import CompressionPlan, check_setting
from lessmem.core.saved_storage import attach, detach
from lessmem.core.spec import FROM_NORM, LayerSpec
from lessmem.core.storage import check_storage


def _swap(module: nn.Module, new_cls: type[nn.Module]) -> None:
    if not hasattr(module, ORIGINAL_CLASS_ATTR):
        object.__setattr__(module, ORIGINAL_CLASS_ATTR, type(module))
    module.__class__ = new_cls


def compress(
    model: nn.Module,
    mapping: Mapping[str, Any] | CompressionPlan | None,
    *,
    exact_companions: bool = True,
    norm_storage: str | Mapping[str, str] = "native",
    act_storage: str | Mapping[str, str] = "native",
    saved_storage: str | Mapping[str, str] = "native",
    recompute: Sequence[str] = (),
) -> nn.Module:
    """Compress ``model`` in place and return it.

    mapping: ordered ``{fnmatch pattern on named_modules() names: kernel}``; kernel is ``k``,
        ``[kh, kw]`` or ``{"kernel": k, "storage": "bf16"|"int8"}``. ``1`` keeps the stock layer
        (bit-identical). ``"from_bn"`` (Conv2d only): the input is not kept but rebuilt in backward
        from what the BatchNorm and ReLU right before the conv keep (``ops.rebuilt_input``): the
        BatchNorm's input (exact: its ``norm_storage`` native, such BatchNorms become
        ``NotedBatchNorm2d``, the same op; or ``"chunked"``) or its code (lossy ``norm_storage``),
        and the ReLU's mask.
        Conv2d inputs are pooled k×k; Linear inputs (..., tokens, features) are
        pooled over k tokens (nn.Linear subclasses that keep Linear's forward, timm's Linear and HF
        GPT-2's Conv1D too). Layers reading one tensor share its pooled copy; a Linear whose input
        its producing op saves anyway (attention's output) keeps a reference to it instead.
    exact_companions: also swap ReLU/ReLU6/Hardtanh for 1-bit-mask versions, MaxPool2d for
        uint8-index versions, and HF's multi-op GELU formulas and Llama's gated MLP for versions
        that recompute them in backward from their inputs. Exact, and needed for real savings:
        otherwise they keep the full-size tensors that pooling was meant to drop.
    norm_storage: ``"native"`` (exact), ``"bf16"`` or ``"int8"`` storage for BatchNorm2d inputs,
        globally or as ``{pattern: storage}``. Lossy: the input gradient becomes approximate.
        ``"chunked"`` (``plan.CHUNKED``) keeps the input as native does, but the backward writes the input
        gradient in batch slices over the incoming one where it may (no full-size buffers of torch's
        kernel): exact, the gradients torch's to float rounding, not bit for bit.
    act_storage: the same for GELU / SiLU inputs (transformer MLPs; torch's classes and timm / HF
        classes computing F.gelu / F.silu). Lossy, opt-in.
    saved_storage: the same for every other floating tensor of >= 4096 elements that autograd
        saves inside the matched modules (any module, ``""`` is the model itself): norm inputs,
        attention's q, k, v and output, elementwise products (``core.saved_storage``). Nested
        matches: the innermost module's rule wins. Parameters and what lessmem's own layers
        store are left alone. Lossy, opt-in: every gradient upstream becomes approximate.
    recompute: module-name patterns of regions (a block, any module) that keep only their inputs and
        rerun their forward in backward, torch's RNG state restored (``ops.recomputed_region``).
        Exact. The map's ``from_bn`` entries inside a region are left out (the region keeps nothing
        to rebuild from); everything else applies there and makes the rerun's backward smaller.
    A ``CompressionPlan`` (what every chooser returns: the menu, ``lessmem.fit``, a run's config) as
    ``mapping`` brings its own map and every setting; the keyword settings must then stay default.
    A plan that does not fit the model is a ValueError naming the layer or pattern.
    """
    if isinstance(mapping, CompressionPlan):
        given = {"exact_companions": exact_companions, "norm_storage": norm_storage,
                 "act_storage": act_storage, "saved_storage": saved_storage, "recompute": recompute}
        defaults = {"exact_companions": True, "recompute": ()}
        ignored = [k for k, v in given.items() if v != defaults.get(k, "native")]
        if ignored:
            raise ValueError(f"compress(model, plan) takes every setting from the plan; drop {ignored} "
                             "or pass plan.replace(...)")
        return compress(model, dict(mapping.map), exact_companions=bool(mapping.exact_companions),
                        norm_storage=mapping.norm_storage, act_storage=mapping.act_storage,
                        saved_storage=mapping.saved_storage, recompute=mapping.recompute)
    uncompress(model)
    regions = _recomputed_regions(model, recompute)
    # A recomputed region keeps nothing between forward and backward, so nothing there can be rebuilt
    # from what another layer keeps: its from_bn entries are left out (everything else applies, and
    # makes the region's rerun in backward smaller).
    specs = {n: s for n, s in resolve_mapping(model, mapping).items() if not (in_regions(n, regions) and s.storage == FROM_NORM)}
    for name, spec in specs.items():
        module = model.get_submodule(name)
        if spec.exact:
            continue
        compressed = compressed_class_of(module)
        if spec.storage == FROM_NORM and (compressed is not CompressedConv2d or not exact_companions):
            raise ValueError(
                f"layer {name!r} is {type(module).__name__}: {FROM_NORM!r} rebuilds a conv's input from the "
                "BatchNorm and ReLU before it" + ("" if compressed is not CompressedConv2d else
                                                   ", which needs exact_companions (the ReLU's 1-bit mask)"))
        if spec.kernel[0] != spec.kernel[1] and compressed is not CompressedConv2d:
            raise ValueError(
                f"layer {name!r} is {type(module).__name__}: it pools tokens, give one size, "
                f"not {spec.kernel}"
            )
        _swap(module, compressed)
        module.lessmem_spec = spec
        module.lessmem_name = name
    if exact_companions:
        for module in model.modules():
            companion = exact_companion_of(module)
            if companion is not None:
                _swap(module, companion)
    for option, rule in (("norm_storage", norm_storage), ("act_storage", act_storage)):
        stored_class_of, kind = _STORED_LAYERS[option]
        for name, storage in _storage_choices(model, rule, stored_class_of, option, kind).items():
            module = model.get_submodule(name)
            _swap(module, stored_class_of(module))
            module.lessmem_storage = storage
    if any(spec.storage == FROM_NORM for spec in specs.values()):
        _note_exact_norms(model)
    for name, (storage, in_layer) in _saved_storage_choices(model, saved_storage).items():
        attach(model.get_submodule(name), storage, in_layer=in_layer, is_model=not name)
    for name in regions:
        if RUN_JOIN in name:
            names = name.split(RUN_JOIN)
            run = RecomputedRun([model.get_submodule(n) for n in names], names)
            for member, n in zip(run.members, names, strict=True):
                model.get_submodule(n).forward = member
        else:
            module = model.get_submodule(name)
            module.forward = RecomputedForward(module, name)
    return model


def _recomputed_regions(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The outermost modules matched by ``patterns`` (the model itself never), and the runs
    (``a+b+c``: sibling module names, checked) as they are."""
    if isinstance(patterns, str):
        raise ValueError(f"recompute: a list of module-name patterns, not the string {patterns!r}")
    names = [n for n, _ in model.named_modules() if n]
    runs = [p for p in patterns if RUN_JOIN in p]
    for run in runs:
        members = run.split(RUN_JOIN)
        missing = [n for n in members if n not in names]
        if missing or len({n.rpartition(".")[0] for n in members}) > 1:
            raise ValueError(f"recompute run {run!r}: name sibling modules (one parent), joined by {RUN_JOIN!r}"
                             + (f"; no module {missing}" if missing else ""))
    patterns = [p for p in patterns if RUN_JOIN not in p]
    for pattern in unmatched(patterns, names):
        listed = ", ".join(repr(n) for n in names[:8])
        raise ValueError(f"recompute pattern {pattern!r} matches no module name; have {listed}, ... "
                         f"({len(names)} modules)")
    chosen: list[str] = []
    in_runs = [n for run in runs for n in run.split(RUN_JOIN)]
    for name in names:
        if first_match(name, patterns) is not None and not any(name.startswith(f"{c}.") for c in chosen):
            if name in in_runs:
                raise ValueError(f"recompute: module {name!r} is in a run and matched alone; choose one")
            chosen.append(name)
    return runs + chosen


def _stored_norm_of(module: nn.Module) -> type[nn.Module] | None:
    return STORED_NORMS.get(type(module))


# Each lossy storage option: the class it swaps a module to (None: out of its reach), and what it reaches.
_STORED_LAYERS: dict[str, tuple[Callable[[nn.Module], type[nn.Module] | None], str]] = {
    "norm_storage": (_stored_norm_of, "BatchNorm2d"),
    "act_storage": (stored_activation_of, "GELU/SiLU"),
}


def _storage_choices(
    model: nn.Module,
    storage_rule: str | Mapping[str, str],
    stored_class_of: Callable[[nn.Module], type[nn.Module] | None],
    option: str,
    kind: str,
) -> dict[str, str]:
    """Name -> lossy storage of each layer with a ``stored_class_of`` that ``storage_rule`` (one
    storage, or ``{pattern: storage}``, first match wins) sends away from ``native``."""
    norms = _reachable(model, stored_class_of)
    rules = {"*": storage_rule} if isinstance(storage_rule, str) else dict(storage_rule)
    chosen: dict[str, str] = {}
    for storage in rules.values():
        check_setting(option, str(storage))
    for pattern in unmatched(rules, norms):
        if pattern != "*":
            raise ValueError(f"{option} pattern {pattern!r} matches no {kind}; have {norms}")
    for name in norms:
        pattern = first_match(name, rules)
        if pattern is not None and rules[pattern] != "native":
            chosen[name] = str(rules[pattern])
    return chosen


def _note_exact_norms(model: nn.Module) -> nn.Module:
    """Swap the BatchNorms left exact for ones noting their input, where a rebuilt conv input
    (``from_bn``) may come from them; returns ``model``."""
    for module in model.modules():
        if type(module) in NOTED_NORMS:
            _swap(module, NOTED_NORMS[type(module)])
    return model


def rebuildable_convs(model: nn.Module, inputs: Tensor | tuple[Tensor, ...]) -> dict[str, str]:
    """The convs of ``model`` that can take ``"from_bn"``, each with the BatchNorm2d it rebuilds its
    input from: those whose input is a ReLU / ReLU6 / Hardtanh output of a BatchNorm2d, passed
    unchanged (found by one training-mode forward of ``inputs`` through an exactly compressed copy;
    ``model`` is not changed). A map ``dict.fromkeys(rebuildable_convs(model, x), "from_bn")``
    rebuilds them all."""
    probe = _note_exact_norms(compress(copy.deepcopy(model), None).train())
    norms = {id(m.weight): n for n, m in probe.named_modules() if isinstance(m, nn.BatchNorm2d)}
    found: dict[str, str] = {}

    def check(name: str) -> Callable[..., None]:
        def read(module: nn.Module, args: tuple) -> None:
            source = noted(args[0], ClampOfNorm)
            if source is not None:
                found.setdefault(name, norms[id(source.norm.weight)])
        return read

    hooks = [m.register_forward_pre_hook(check(n)) for n, m in probe.named_modules() if isinstance(m, nn.Conv2d)]
    with torch.enable_grad():
        probe(*(inputs if isinstance(inputs, tuple) else (inputs,)))
    for hook in hooks:
        hook.remove()
    return found


def storable_layers(model: nn.Module) -> dict[str, list[str]]:
    """Names of the layers each lossy storage option can reach: ``{"norm_storage": [BatchNorm2d
    names], "act_storage": [GELU / SiLU names]}``, in module order."""
    return {option: _reachable(model, stored_class_of) for option, (stored_class_of, _) in _STORED_LAYERS.items()}


def _reachable(model: nn.Module, stored_class_of: Callable[[nn.Module], type[nn.Module] | None]) -> list[str]:
    return [n for n, m in model.named_modules() if stored_class_of(m) is not None]


def _saved_storage_choices(model: nn.Module, storage_rule: str | Mapping[str, str]) -> dict[str, tuple[str, bool]]:
    """Name -> (storage, is one of lessmem's layers) of each module that needs ``saved_storage``
    hooks of its own: where ``storage_rule`` (one storage, or ``{pattern: storage}``, first match
    wins, the innermost matched module's rule applies) changes the storage, lessmem's layers in
    a lossy region, and the model itself (whose inputs are held). None when nothing is lossy."""
    rules = {"*": storage_rule} if isinstance(storage_rule, str) else dict(storage_rule)
    for storage in rules.values():
        check_storage(str(storage))
    names = [n for n, _ in model.named_modules()]
    for pattern in unmatched(rules, names):
        if pattern != "*":
            listed = ", ".join(repr(n) for n in names[1:9])
            raise ValueError(f"saved_storage pattern {pattern!r} matches no module name; have {listed}, ... "
                             f"({len(names) - 1} modules, '' is the model itself)")
    effective: dict[str, str] = {}
    chosen: dict[str, tuple[str, bool]] = {}
    for name, module in model.named_modules():
        parent = effective.get(name.rpartition(".")[0], "native") if name else "native"
        pattern = first_match(name, rules)
        storage = effective[name] = str(rules[pattern]) if pattern is not None else parent
        in_layer = ORIGINAL_CLASS_ATTR in module.__dict__ and storage != "native"
        if in_layer or storage != parent:
            chosen[name] = (storage, in_layer)
    if not chosen:
        return {}
    return {"": (effective[""], False)} | chosen


def uncompress(model: nn.Module) -> nn.Module:
    """Restore every swapped layer to its stock class and remove ``saved_storage`` hooks (in
    place); returns ``model``."""
    for module in model.modules():
        detach(module)
        recomputed = module.__dict__.get("forward")
        if isinstance(recomputed, (RecomputedForward, RunMember)):
            del module.forward
            if recomputed.replaced is not None:
                module.forward = recomputed.replaced
        original = module.__dict__.pop(ORIGINAL_CLASS_ATTR, None)
        if original is None and type(module) in STOCK_OF:
            original = STOCK_OF[type(module)]
        if original is not None:
            module.__class__ = original
            module.__dict__.pop("lessmem_spec", None)
            module.__dict__.pop("lessmem_storage", None)
            module.__dict__.pop("lessmem_name", None)
    return model


def compressed_layers(model: nn.Module) -> dict[str, LayerSpec]:
    """Name -> spec of every layer currently compressed."""
    return {n: m.lessmem_spec for n, m in model.named_modules() if hasattr(m, "lessmem_spec")}

