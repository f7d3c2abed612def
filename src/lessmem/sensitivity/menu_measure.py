"""Measure the whole compressor menu (pooling kernel x storage for conv and token-linear inputs,
storage for BatchNorm and GELU / SiLU inputs and for what other modules save themselves: norms,
attention, gated products) of a model on a few batches (``lessmem.sensitivity.menu``).

Per batch: one exact forward/backward (exact companions, bit-identical to stock) whose conv
hooks recompute each conv's weight gradient from its input pooled and stored every way the menu
offers; then one compressed forward/backward per lossy BatchNorm / activation / saved-region
option, which carries that option's error into every earlier layer as training would. Stochastic rounding and
dropout draw the same noise in every pass of a batch, and the global rounding stream and torch
RNG are left as they were.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core import (
    FROM_NORM,
    CompressionPlan,
    compress,
    kept_by_graph,
    load_rounding_state,
    measure_memory,
    rebuildable_convs,
    rounding_state,
    storable_layers,
    stored_bytes,
)
from lessmem.core.memory import saved_tensors_of
from lessmem.core.ops.recomputed_region import in_regions
from lessmem.sensitivity.exact_fit import forward_seconds, run_candidates
from lessmem.sensitivity.exact_fit import region_candidates as block_candidates
from lessmem.sensitivity.geometry import (
    SensitivityLayer,
    TokenLinearLayer,
    sensitivity_layers,
)
from lessmem.sensitivity.items import (
    JOINT_KIND,
    MenuItem,
    RecomputeOption,
    joint_option,
    option_name,
)
from lessmem.sensitivity.menu import CRITERIA, MenuResult
from lessmem.sensitivity.menu_options import DEFAULT_MENU, MenuOptions
from lessmem.sensitivity.regions import region_candidates, region_groups, region_rule
from lessmem.sensitivity.weight_grad import (
    conv_weight_grad,
    linear_weight_grad,
    pooled_numel,
    pooled_weight_grad,
)

Batch = Tensor | tuple[Tensor, Tensor] | list[Tensor]


def measure_menu(
    model: nn.Module,
    batches: Iterable[Batch],
    menu: MenuOptions = DEFAULT_MENU,
    loss_fn: Callable[[Tensor, Tensor | None], Tensor] | None = None,
) -> MenuResult:
    """Every option of ``menu``: its bytes and gradient error on ``batches`` (``images`` or
    ``(images, labels)``), for ``model`` in its current mode; ``model`` itself is not changed.
    ``MenuOptions.kernel_only()`` is the kernel-only menu (pooling alone). loss_fn(output,
    targets): cross-entropy by default (mean square of the output without targets); pass the
    training loss for other outputs (a language model's next-token loss)."""
    kernels = sorted(set(menu.kernels))
    loss_fn = loss_fn or _default_loss
    net = compress(copy.deepcopy(model), None)  # exact companions: the bytes a map starts from
    layers = sensitivity_layers(net)
    reach = storable_layers(net)
    probes = [("norm", n, s) for n in reach["norm_storage"] for s in menu.norm_storages if s != "native"]
    probes += [("act", n, s) for n in reach["act_storage"] for s in menu.act_storages if s != "native"]
    lossy_saved = [s for s in menu.saved_storages if s != "native"]
    regions: dict[str, bool] = {}  # saved-region item -> whether its module has children (shielded)
    units: dict[str, list[str]] = {}  # regions choosing together, by their first member
    region_bytes: dict[str, int] = {}  # per unit
    probe_delta: dict[tuple[str, str], int] = {}  # saved bytes an option adds to the exact model
    token_kernels = sorted(set(menu.token_kernels))
    recorder = _MenuRecorder(layers, [(k, s) for k in kernels for s in menu.storages],
                             [(k, s) for k in token_kernels for s in menu.storages])
    lossy_inputs = _InputSizes(net, [*reach["norm_storage"], *reach["act_storage"]])
    params = [p for p in net.parameters() if p.requires_grad]
    sizes = [p.numel() for p in params]
    device = params[0].device
    state, first, first_y = rounding_state(), None, None
    probe_stats: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
    pairs: dict[str, str] = {}  # conv -> the BatchNorm it can rebuild its input from (norm_conv items)
    n_batches = 0
    try:
        for batch_no, batch in enumerate(batches):
            x, y = _split(batch)
            x, y = x.to(device), None if y is None else y.to(device)
            if first is None:
                first, first_y = x, y
            recorder.batch_storage = x.untyped_storage().data_ptr()
            exact, saved = _flat_grad(net, params, x, y, loss_fn, batch_no, hooks=(recorder, lossy_inputs),
                                      count_saved=batch_no == 0)
            norm2 = float(exact.square().sum())
            tensor_norm2 = [float(t.square().sum()) for t in exact.split(sizes)]
            recorder.finish_batch(norm2, sum(n > 0 for n in tensor_norm2))
            if batch_no == 0:  # the exact-companion model's bytes: what every option is measured against
                exact_total = saved
                if lossy_saved:
                    items_named = {*(layer.name for layer in layers), *reach["norm_storage"], *reach["act_storage"]}
                    regions, units, region_bytes = _saved_regions(net, x, items_named, lossy_saved, probe_delta)
                    probes += [("saved", n, s) for n in units for s in lossy_saved]
                if menu.from_bn:
                    pairs = _rebuildable_pairs(net, x, recorder, reach["norm_storage"])
                    norm_options = ["native", *(s for s in menu.norm_storages if s != "native")]
                    probes += [(FROM_NORM, conv, s) for conv in pairs for s in norm_options]
            for kind, name, storage in probes:
                _apply_probe(net, kind, name, storage, regions, units, pairs)
                count = batch_no == 0 and kind != "saved"  # measured, not assumed: a companion may keep the input anyway
                approx, saved = _flat_grad(net, params, x, y, loss_fn, batch_no, count_saved=count)
                if count:
                    probe_delta[(name, storage)] = saved - exact_total
                sq_err, dot, cos = _error_terms(exact, approx)
                probe_stats.setdefault((name, storage), []).append(
                    (sq_err / norm2, dot / norm2, cos, _tensor_error(exact - approx, sizes, tensor_norm2))
                    if norm2 > 0 else (0.0, 0.0, 1.0, 0.0))
            compress(net, None)
            n_batches += 1
    finally:
        load_rounding_state(state)
    if n_batches == 0:
        raise ValueError("measure_menu got no batches")
    stock = measure_memory(copy.deepcopy(model), first).total_bytes
    base = exact_total
    items = recorder.items(n_batches)
    lossy_items = [("norm", n) for n in reach["norm_storage"]] + [("act", n) for n in reach["act_storage"]]
    for kind, name in lossy_items + [("saved", n) for n in units]:
        wanted = {"norm": menu.norm_storages, "act": menu.act_storages, "saved": menu.saved_storages}[kind]
        options = ["native", *[s for s in wanted if s != "native"]]
        numel, elem = lossy_inputs.sizes[name] if kind != "saved" else (region_bytes[name], 1)
        rows = {c: [[0.0 if o == "native" else probe_stats[(name, o)][b][i] for o in options]
                    for b in range(n_batches)]
                for i, c in enumerate(CRITERIA)}  # a probe's terms are in CRITERIA's order
        for b in range(n_batches):
            rows["cosine"][b][0] = 1.0
        native = numel * elem
        nbytes = [native if o == "native" else native + probe_delta[(name, o)] for o in options]
        if kind != "saved" or len(units[name]) == 1:
            items.append(MenuItem(name, kind, options, nbytes, rows, shielded=regions.get(name, False)))
            continue
        # Regions sharing a saved tensor: one unit of the unit's bytes; its first member carries the
        # unit's measured error, the others add none (cosine 1).
        group = len({i.group for i in items})
        neutral = {c: [[1.0 if c == "cosine" else 0.0] * len(options) for _ in range(n_batches)] for c in rows}
        items += [MenuItem(member, kind, options, nbytes, rows if j == 0 else neutral, group, regions[member])
                  for j, member in enumerate(units[name])]
    items = _joined(items, pairs, probe_stats, probe_delta, n_batches)
    # What the map controls comes off the exact-companion total: each item's exact option once.
    base -= sum(i.nbytes[i.index(i.exact_option)] for i in items if i.group is None)
    base -= sum({i.group: i.nbytes[i.index(i.exact_option)] for i in items if i.group is not None}.values())
    meta = {"batches": n_batches, "batch_size": int(first.shape[0]), "kernels": kernels,
            "token_kernels": token_kernels, "storages": list(menu.storages), "norm_storages": list(menu.norm_storages),
            "act_storages": list(menu.act_storages), "saved_storages": list(menu.saved_storages),
            "from_bn": menu.from_bn}
    if not menu.recompute:
        return MenuResult(items, stock, base, meta)
    regions, meta["step_seconds"] = _recompute_options(net, first, first_y, loss_fn, items)
    return MenuResult(items, stock, base, meta, regions)


def _recompute_options(net: nn.Module, x: Tensor, y: Tensor | None, loss_fn: Callable[[Tensor, Tensor | None], Tensor],
                       items: list[MenuItem]) -> tuple[list[RecomputeOption], float]:
    """The exact-companion ``net``'s blocks and runs of layers as recompute options, and a training
    step's seconds (least of two). Each region's ``delta_bytes`` from a saved-tensor count with it
    recomputed alone, twice: among exact items and among every item at its smallest option (a kept
    input that an exact neighbour's saved tensor shares costs nothing there, a full copy beside
    codes), the larger kept, so that no map of the menu is predicted below its bytes; what the menu
    drops for it is added back (``MenuResult.kept_inside``: its units wholly inside, and its share of
    a unit spanning several regions, each decoder layer's attention). A region holding a conv but not the
    BatchNorm its ``from_bn`` options rebuild from (or the other way round: a ResNet's stem and its
    first block's conv1) is not offered."""
    menu = MenuResult(items, 1, 0)  # its units and choices; bytes are not read from it
    smallest = menu.smallest_choice()
    contexts = {"exact": (CompressionPlan(exact_companions=True), {i.name: i.exact_option for i in items}),
                "smallest": (menu.choice_of(smallest).plan, smallest)}
    totals = {}
    for context, (plan, _) in contexts.items():
        compress(net, plan)
        totals[context] = measure_memory(net, x).total_bytes
    compress(net, None)
    candidates = [*run_candidates(net, x), *block_candidates(net)]
    seconds = forward_seconds(net, x, candidates)
    pairs = [(i.name, str(i.partner)) for i in items if i.kind == JOINT_KIND]
    options = []
    for name in candidates:
        if any(in_regions(conv, (name,)) != in_regions(norm, (name,)) for conv, norm in pairs):
            continue  # it would split a conv from the BatchNorm its from_bn options rebuild from
        deltas, freed = [], 0
        try:
            for context, (plan, chosen) in contexts.items():
                compress(net, dataclasses.replace(plan, recompute=(name,)))
                total = measure_memory(net, x).total_bytes
                deltas.append(total - totals[context] + round(menu.kept_inside(chosen, (name,))))
                freed = freed or totals[context] - total
        except (RuntimeError, TypeError):  # a run its parent does not call as one
            continue
        finally:
            compress(net, None)
        options.append(RecomputeOption(name, max(deltas), seconds[name], freed))
    step = math.inf
    for _ in range(2):
        start = time.perf_counter()
        loss_fn(net(x), y).backward()
        step = min(step, time.perf_counter() - start)
    net.zero_grad(set_to_none=True)
    return options, step


def _apply_probe(net: nn.Module, kind: str, name: str, storage: str, regions: dict[str, bool],
                 units: dict[str, list[str]], pairs: dict[str, str]) -> None:
    """Compress ``net`` with one lossy option of one BatchNorm / activation item or saved-region unit,
    or (``from_bn``) with conv ``name`` rebuilding its input from its BatchNorm stored as ``storage``."""
    if kind == "saved":
        compress(net, None, saved_storage=region_rule(dict.fromkeys(units[name], storage), regions))
    elif kind == FROM_NORM:
        compress(net, {name: FROM_NORM}, norm_storage={pairs[name]: storage})
    else:
        compress(net, None, **{"norm_storage" if kind == "norm" else "act_storage": {name: storage}})


def _rebuildable_pairs(net: nn.Module, x: Tensor, recorder: _MenuRecorder, norms: list[str]) -> dict[str, str]:
    """conv -> BatchNorm for the convs of ``net`` that can take ``from_bn`` and are menu items of
    their own (a conv sharing its input with another chooses with it: not offered)."""
    readers: dict[tuple, int] = {}
    for key in recorder.groups.values():
        readers[key] = readers.get(key, 0) + 1
    return {conv: bn for conv, bn in rebuildable_convs(net, x).items()
            if conv in recorder.groups and readers[recorder.groups[conv]] == 1 and bn in norms}


def _joined(items: list[MenuItem], pairs: dict[str, str], probe_stats: dict[tuple[str, str], list],
            probe_delta: dict[tuple[str, str], int], n_batches: int) -> list[MenuItem]:
    """``items`` with each conv of ``pairs`` and its BatchNorm replaced by one norm_conv item: every
    BatchNorm storage with every conv option (criteria added, cosines multiplied, bytes added: the
    two errors taken as independent, as between items) and every BatchNorm storage with the input
    rebuilt (``from_bn``: measured by a compressed backward with both applied, bytes counted)."""
    if not pairs:
        return items
    by_name = {i.name: i for i in items}
    joined: dict[str, MenuItem] = {}
    for conv_name, norm_name in pairs.items():
        conv, norm = by_name[conv_name], by_name[norm_name]
        composed = [(a, b) for a in range(len(norm.options)) for b in range(len(conv.options))]
        options = [joint_option(norm.options[a], conv.options[b]) for a, b in composed]
        options += [joint_option(n, FROM_NORM) for n in norm.options]
        exact = norm.nbytes[norm.index("native")] + conv.nbytes[conv.index("1")]
        nbytes = [norm.nbytes[a] + conv.nbytes[b] for a, b in composed]
        nbytes += [exact + probe_delta[(conv_name, n)] for n in norm.options]
        rows = {}
        for i, c in enumerate(CRITERIA):  # a probe's terms are in CRITERIA's order
            rows[c] = [[norm.criteria[c][k][a] * conv.criteria[c][k][b] if c == "cosine"
                        else norm.criteria[c][k][a] + conv.criteria[c][k][b] for a, b in composed]
                       + [probe_stats[(conv_name, n)][k][i] for n in norm.options] for k in range(n_batches)]
        joined[conv_name] = MenuItem(conv_name, JOINT_KIND, options, nbytes, rows, partner=norm_name)
    partners = set(pairs.values())
    return [joined.get(i.name, i) for i in items if i.name not in partners]


def _saved_regions(net: nn.Module, x: Tensor, items: set[str], storages: list[str],
                   delta: dict[tuple[str, str], int]
                   ) -> tuple[dict[str, bool], dict[str, list[str]], dict[str, int]]:
    """The saved-region items of ``net`` (exact companions on) on input ``x``: (name -> has
    children, first member -> the regions choosing together, first member -> their own native
    saved bytes); fills ``delta[(first member, storage)]`` with the bytes each storage adds
    (negative) to the whole model, measured. A unit whose every storage leaves its bytes unchanged
    (what it saves is not floating, small, or lessmem's own) is none."""
    exact = measure_memory(net, x)
    children = {n: any(True for _ in m.children()) for n, m in net.named_modules()}
    units: dict[str, list[str]] = {}
    for members in region_groups(net, x, region_candidates(net, exact.per_layer, items)):
        for storage in storages:
            compress(net, None, saved_storage=region_rule(dict.fromkeys(members, storage), children))
            delta[(members[0], storage)] = measure_memory(net, x).total_bytes - exact.total_bytes
        if any(delta[(members[0], s)] for s in storages):
            units[members[0]] = members
    compress(net, None)
    regions = {m: children[m] for members in units.values() for m in members}
    return regions, units, {n: sum(exact.per_layer[m] for m in members) for n, members in units.items()}


def _split(batch: Batch) -> tuple[Tensor, Tensor | None]:
    if isinstance(batch, (tuple, list)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    return batch, None


def _default_loss(out: Tensor, target: Tensor | None) -> Tensor:
    if target is None:  # no labels: any scalar works for the criteria; this one is label-free
        return out.float().square().mean()
    return F.cross_entropy(out, target)


def _flat_grad(net: nn.Module, params: list[nn.Parameter], x: Tensor, y: Tensor | None,
               loss_fn: Callable[[Tensor, Tensor | None], Tensor], batch_no: int,
               hooks: tuple = (), count_saved: bool = False) -> tuple[Tensor, int]:
    """The whole parameter gradient of one batch, flattened (float64), and with ``count_saved`` the
    bytes its forward saved for backward (``measure_memory``'s total, counted in this pass rather
    than in a forward of its own); the same rounding noise and RNG draws for every pass over batch
    ``batch_no``."""
    load_rounding_state({"seed": 0x5EED + batch_no, "calls": 0})
    handles = [h for hook in hooks for h in hook.attach()]
    try:
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
            torch.manual_seed(batch_no)
            if count_saved:
                records, out = saved_tensors_of(net, (x,))
                saved = sum(r.nbytes for r in records)
            else:
                out, saved = net(x), 0
            loss = loss_fn(out, y)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return torch.cat([(torch.zeros_like(p) if g is None else g).detach().double().flatten()
                      for p, g in zip(params, grads, strict=True)]), saved


def _error_terms(exact: Tensor, approx: Tensor) -> tuple[float, float, float]:
    """(||a - e||^2, <e, e - a>, cos(e, a)) of two gradients in float64; the first two are divided
    by the whole gradient's squared norm to become the menu's criteria. Two zero gradients
    agree (cosine 1), one zero gradient does not (0)."""
    e, a = exact.double().flatten(), approx.double().flatten()
    diff = e - a
    norm = float(e.norm()) * float(a.norm())
    cos = float(e @ a) / norm if norm > 0 else float(not e.any() and not a.any())
    return float(diff @ diff), float(e @ diff), cos


def _tensor_error(diff: Tensor, sizes: list[int], tensor_norm2: list[float]) -> float:
    """Mean over the parameter tensors with a gradient of ||diff_t||^2 / ||g_t||^2 (the
    ``tensor_error`` criterion)."""
    errors = [float(d.square().sum()) / n for d, n in zip(diff.split(sizes), tensor_norm2, strict=True) if n > 0]
    return sum(errors) / len(errors) if errors else 0.0


class _InputSizes:
    """(numel, element size) of the input of each named layer, from forward pre-hooks."""

    def __init__(self, net: nn.Module, names: list[str]) -> None:
        self.net, self.names = net, sorted(set(names))
        self.sizes: dict[str, tuple[int, int]] = {}

    def attach(self) -> list:
        def hook(name: str):
            def record(module: nn.Module, args: tuple) -> None:
                self.sizes[name] = (args[0].numel(), args[0].element_size())
            return record
        return [self.net.get_submodule(n).register_forward_pre_hook(hook(n)) for n in self.names]


class _MenuRecorder:
    """Conv and token-linear hooks: each layer's exact weight gradient and, per menu option (conv
    options for convs, token options for token linears), the one taken from its input pooled (k x k
    blocks, or groups of k tokens) and stored that way; per batch, squared error and inner products
    (normalised by the whole gradient's squared norm once the backward is done)."""

    def __init__(self, layers: list[SensitivityLayer], conv_options: list[tuple[int, str]],
                 token_options: list[tuple[int, str]]) -> None:
        self.layers, self.conv_options, self.token_options = layers, conv_options, token_options
        # per option of the current batch: squared error, inner product, cosine, squared error / ||g_w||^2
        self.raw: dict[str, list[tuple[float, float, float, float]]] = {}
        self.stats: dict[str, dict[str, list[list[float]]]] = {}
        self.shapes: dict[str, tuple[tuple[int, ...], int]] = {}
        self.groups: dict[str, tuple[int, tuple[int, ...], str]] = {}
        self.caller_held: set[str] = set()
        # The storage of the batch the model is called on: a layer reading it (or a view of it) adds
        # nothing by keeping it, as ``measure_memory`` counts; any other input is the graph's to keep,
        # a no-grad one too (a frozen embedding's output, in a LoRA model).
        self.batch_storage: int | None = None

    def _options(self, layer: SensitivityLayer) -> list[tuple[int, str]]:
        return self.token_options if isinstance(layer, TokenLinearLayer) else self.conv_options

    def attach(self) -> list:
        return [layer.module.register_forward_hook(self._forward_hook(layer)) for layer in self.layers]

    def _forward_hook(self, layer: SensitivityLayer):
        tokens = isinstance(layer, TokenLinearLayer)

        def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            x = args[0]
            if not torch.is_grad_enabled() or not out.requires_grad:
                return
            if tokens and (x.dim() < 3 or kept_by_graph(x)):
                return  # the core runs the stock linear there whatever the map says: nothing to choose
            pre_pad = None if tokens else layer.pre_pad
            if pre_pad is None and x.untyped_storage().data_ptr() == self.batch_storage:
                self.caller_held.add(layer.name)
            # One tensor read by several layers is stored once per option (a pre-padded input is a
            # fresh tensor per conv, so it never shares).
            owner = layer.name if pre_pad is not None else ""
            self.groups[layer.name] = (x.untyped_storage().data_ptr(), tuple(x.shape), owner)
            saved = x.detach()
            out.register_hook(lambda g: self._backward(layer, saved, g))
        return hook

    def _backward(self, layer: SensitivityLayer, x: Tensor, grad_out: Tensor) -> None:
        tokens = isinstance(layer, TokenLinearLayer)
        if not tokens and layer.pre_pad is not None:
            x = layer.pre_pad(x)
        self.shapes[layer.name] = (tuple(x.shape), x.element_size())
        exact = linear_weight_grad(grad_out, x) if tokens else conv_weight_grad(layer, grad_out, x)
        own2 = float(exact.double().square().sum())
        rows = [(0.0, 0.0, 1.0) if k == 1 and storage == "native"
                else _error_terms(exact, pooled_weight_grad(layer, grad_out, x, k, storage))
                for k, storage in self._options(layer)]
        self.raw[layer.name] = [(*r, r[0] / own2 if own2 > 0 else 0.0) for r in rows]

    def finish_batch(self, grad_norm2: float, n_tensors: int) -> None:
        """Normalise the batch's terms: by the whole gradient's squared norm, and (``tensor_error``:
        a conv or linear input touches its own weight tensor only) by the number of parameter
        tensors with a gradient."""
        scale = 1.0 / grad_norm2 if grad_norm2 > 0 else 0.0
        for name, rows in self.raw.items():
            stats = self.stats.setdefault(name, {c: [] for c in CRITERIA})
            stats["grad_error"].append([r[0] * scale for r in rows])
            stats["loss_change"].append([r[1] * scale for r in rows])
            stats["cosine"].append([r[2] for r in rows])
            stats["tensor_error"].append([r[3] / max(n_tensors, 1) for r in rows])
        self.raw = {}

    def items(self, n_batches: int) -> list[MenuItem]:
        group_ids: dict[tuple[int, tuple[int, ...], str], int] = {}
        out = []
        for layer in self.layers:
            name = layer.name
            if name not in self.stats or len(self.stats[name]["grad_error"]) != n_batches:
                continue  # never reached the loss
            shape, elem = self.shapes[name]
            tokens, options = isinstance(layer, TokenLinearLayer), self._options(layer)
            nbytes = [(0 if name in self.caller_held else math.prod(shape) * elem) if k == 1 and storage == "native"
                      else stored_bytes(pooled_numel(shape, k, tokens), storage, elem)
                      for k, storage in options]
            group = group_ids.setdefault(self.groups[name], len(group_ids))
            out.append(MenuItem(name, "linear" if tokens else "conv", [option_name(k, s) for k, s in options],
                                nbytes, self.stats[name], group))
        return out
