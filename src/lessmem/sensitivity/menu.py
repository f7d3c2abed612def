"""What a storage-menu measurement found, and the maps read from it.

One item per place a map can compress: every Conv2d input and every token-pooling linear's input
(options: pooling kernel x storage, written ``"2"``, ``"2/int4"``, ``"int4"``; k x k blocks or groups
of k tokens), every BatchNorm2d input and every GELU / SiLU input, and every saved-tensor region
(``lessmem.sensitivity.regions``: what a module other than those saves itself, a norm's input,
attention's q / k / v / output, a gated product; options: a storage, its bytes measured with the
option applied). A conv that reads ReLU(BatchNorm) alone and that BatchNorm are one ``norm_conv`` item
(``MenuOptions.from_bn``): every pair of their options, and the conv's input rebuilt from the
BatchNorm in each of its storages (``"int2|from_bn"``), whose error depends on that storage. Per
item, option and batch four criteria:

- ``grad_error``: ||g_hat - g||^2 / ||g||^2 with g the whole parameter gradient. A conv input
  touches only its own weight gradient and leaves the backward exact, so these add up over conv
  items exactly; BatchNorm / activation / region storages change the gradient of every earlier layer and
  are measured by an actual compressed backward (GACT's probing), their errors added as if
  independent.
- ``loss_change``: <g, g - g_hat> / ||g||^2, how much less a step of SGD lowers the loss to
  first order (additive in the same way); a map's score is the absolute value of the sum.
- ``cosine``: cosine of the layer's weight gradient (conv) or of the whole gradient (probes);
  a map's score is the mean over items (the issue-12 criterion).
- ``tensor_error``: the mean over parameter tensors of ||g_hat_t - g_t||^2 / ||g_t||^2, every
  tensor counting alike (additive like ``grad_error``). Behind BatchNorm a conv's output scale does
  not matter, only its gradient's direction does, and BatchNorm's own weight and bias, a tiny
  share of the whole gradient's norm, are where lossy BatchNorm inputs do their harm: the whole
  gradient's error cannot see it (docs/proofs.md, resnet20 at 0.08x).

Bytes: what each option keeps, exactly as ``lessmem.measure_memory`` counts it. A map's total is
``base_bytes`` (everything no item controls, under exact companions) plus the items' bytes, with
the layers reading one tensor (ResNet's conv1 and downsample) storing each distinct option once.

Recompute (``MenuOptions.recompute``): the model's blocks and runs of sibling layers, each with its
measured bytes and forward seconds (``RecomputeOption``). A recomputed region's items keep nothing
between forward and backward (the region adds its ``delta_bytes``); its rerun in backward stores them
for the region's own backward, in ``RERUN_STORAGE`` where the item offers it (their error counts, their
bytes are that backward's transient only: a float32 rerun of one tiny Llama decoder layer set the
step's peak, 0.451x stock's, against 0.330x with int8 inside). ``make_map(..., max_step_ratio=r)`` tries the
regions one more at a time (most bytes freed per second of rerun first) while the reruns' seconds stay
within ``r`` times a stock step's (measured with the menu) and keeps the map of least criterion
(``MIN_GAIN`` and ``MIN_ABS_GAIN`` lower than the best before it): time traded for error where codes alone would have to
go lossier. A region keeps its input at full precision, so it pays where its internals outweigh its
input (a transformer layer's attention and 4x-wide MLP), not where codes are already a sixteenth.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lessmem.core import CompressionPlan, StorageRule, first_match, parse_spec
from lessmem.core.ops.recomputed_region import in_regions
from lessmem.core.plan import CHUNKED
from lessmem.sensitivity.items import (
    JOINT_KIND,
    MAP_KINDS,
    MenuItem,
    RecomputeOption,
    joint_option,
    option_name,
    shared_options,
    split_joint,
)
from lessmem.sensitivity.knapsack import least_value_choice
from lessmem.sensitivity.menu_plot import plot_menu
from lessmem.sensitivity.regions import region_rule

CRITERIA = ("grad_error", "loss_change", "cosine", "tensor_error")
# The criterion make_map uses unless told otherwise. On the criterion check's 27 maps every
# criterion ranks accuracy alike (Spearman 0.83-0.86, within noise); at 0.08x on resnet20 the mean
# cosine's map (1-bit BatchNorm inputs) lost 6-7 top-1 points to this one's (docs/proofs.md).
DEFAULT_CRITERION = "tensor_error"
# make_map spends rerun time only for a criterion at least this much lower than the map with one
# region set fewer, relative and absolute: not +15% step time to shave an int8 map's 1e-6, nor +25%
# for a tiny Llama's 6e-5 -> 5e-5 (int8 codes' own error is some 1e-5 per item).
MIN_GAIN = 0.1
MIN_ABS_GAIN = 1e-3
# What a recomputed region's items store for the region's own backward (the rerun's transient; an
# item without it keeps its exact option): int8 codes, whose error is far below the criterion's scale
# of interest (the 0.25x maps of int8 codes train to stock's val_ppl at convergence, docs/proofs.md).
RERUN_STORAGE = "int8"


@dataclass(frozen=True)
class ScoredPlan:
    """A plan read from a menu and the menu's score of it: every criterion, the predicted saved
    ``bytes`` and their ``ratio`` to stock."""

    plan: CompressionPlan
    score: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "score": self.score}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScoredPlan:
        return cls(CompressionPlan.from_dict(data["plan"]), dict(data["score"]))

    def reruns_note(self) -> str:
        """A map header's words on its recomputed regions ("" without): how many, and the step time
        their reruns are predicted to add (the codes cost time of their own)."""
        if not self.plan.recompute:
            return ""
        return (f"; {len(self.plan.recompute)} regions recomputed, their reruns predicted to add "
                f"{self.score['step_ratio'] - 1:.0%} of stock's step")


@dataclass
class MenuResult:
    items: list[MenuItem]
    stock_bytes: int  # stock PyTorch, same model and batch
    base_bytes: int  # bytes no item controls (exact companions on)
    meta: dict[str, Any] = field(default_factory=dict)
    regions: list[RecomputeOption] = field(default_factory=list)  # what it can recompute (MenuOptions.recompute)

    # ---- scoring --------------------------------------------------------------------------------

    @property
    def criteria(self) -> tuple[str, ...]:
        """The criteria every item was measured with (a menu measured before ``tensor_error``
        existed lacks it)."""
        return tuple(c for c in CRITERIA if all(c in i.criteria for i in self.items))

    def options_of(self, plan: CompressionPlan) -> dict[str, str]:
        """Item name -> the option ``plan`` gives it. A saved-region item takes the rule's first
        match on its own name (its bytes are exact for rules of ``region_rule``'s form, which
        ``make_map`` and ``uniform_choice`` write)."""
        conv_rule = _conv_rule(plan.map)
        rules = {"conv": conv_rule, "linear": conv_rule, "norm": _storage_rule(plan.norm_storage),
                 "act": _storage_rule(plan.act_storage), "saved": _storage_rule(plan.saved_storage)}

        def option(name: str, kind: str, exact: str) -> str:
            pattern = first_match(name, rules[kind])
            return exact if pattern is None else rules[kind][pattern]

        chosen = {}
        for item in self.items:
            if item.kind == JOINT_KIND:  # the conv's option by the map, its BatchNorm's by norm_storage
                chosen[item.name] = joint_option(option(str(item.partner), "norm", "native"), option(item.name, "conv", "1"))
            else:
                chosen[item.name] = option(item.name, item.kind, item.exact_option)
            item.index(chosen[item.name])
        return chosen

    def score(self, plan: CompressionPlan) -> dict[str, float]:
        """Every criterion and the predicted saved bytes (and ratio to stock) of a plan; with
        regions recomputed, the predicted ``step_ratio`` too."""
        return self._score(self.options_of(plan), self._recomputed(plan))

    def item_values(self, plan: CompressionPlan, criterion: str = DEFAULT_CRITERION) -> dict[str, tuple[str, float]]:
        """Item name -> the option ``plan`` gives it and that option's additive ``criterion`` value
        (what ``make_map`` sums; an item rerun in backward: ``"recomputed, <option>"``): where a plan's
        predicted error lies, item by item."""
        chosen, inside = self.options_of(plan), self._inside(self.kept_shares([r.name for r in self._recomputed(plan)]))
        return {i.name: (f"recomputed, {chosen[i.name]}" if i.name in inside else chosen[i.name],
                         _additive(i, criterion)[i.index(chosen[i.name])]) for i in self.items}

    def _recomputed(self, plan: CompressionPlan) -> list[RecomputeOption]:
        known = {r.name: r for r in self.regions}
        if missing := [n for n in plan.recompute if n not in known]:
            raise ValueError(f"the plan recomputes {missing}, which this menu did not measure "
                             f"(measure it with menu.recompute=true; it has {sorted(known) or 'none'})")
        return [known[n] for n in plan.recompute]

    def _inside(self, shares: Mapping[str, float]) -> set[str]:
        """The items of the units the regions keep nothing of (``kept_shares``: wholly inside)."""
        return {m.name for u in self._units() if not shares[u[0].name] for m in u}

    def kept_shares(self, names: Sequence[str]) -> dict[str, float]:
        """Unit (its first item's name) -> the share of its bytes kept with the regions ``names``
        recomputed: none for a unit wholly inside; for saved tensors grouped across modules (each
        decoder layer's attention, sharing Llama's rotary table) the share of its members outside;
        else all (a tensor several layers read stays while one of them is outside)."""
        shares = {}
        for u in self._units():
            outside = sum(not in_regions(m.name, names) for m in u) if names else len(u)
            partial = 0 < outside < len(u) and u[0].kind == "saved"
            shares[u[0].name] = outside / len(u) if partial else float(outside > 0)
        return shares

    def kept_inside(self, chosen: Mapping[str, str], names: Sequence[str]) -> float:
        """The bytes the regions ``names`` keep nothing of, under ``chosen`` (item -> option): their
        units' bytes less the share kept (``kept_shares``)."""
        shares = self.kept_shares(names)
        return sum(u[0].nbytes[u[0].index(chosen[u[0].name])] * (1 - shares[u[0].name]) for u in self._units())

    def smallest_choice(self) -> dict[str, str]:
        """Item -> the option of fewest bytes its unit can choose."""
        chosen: dict[str, str] = {}
        for members in self._units():
            least = min(shared_options(members), key=lambda o: members[0].nbytes[members[0].index(o)])
            chosen |= dict.fromkeys((m.name for m in members), least)
        return chosen

    def step_ratio(self, regions: list[RecomputeOption]) -> float:
        """The predicted step time over stock's with ``regions`` recomputed: their forwards added."""
        return 1.0 + sum(r.seconds for r in regions) / self.meta["step_seconds"] if regions else 1.0

    def _score(self, chosen: Mapping[str, str], regions: list[RecomputeOption] | None = None) -> dict[str, float]:
        criteria = self.criteria
        totals = dict.fromkeys(criteria, 0.0)
        group_options: dict[tuple[int, str], float] = {}
        nbytes = self.base_bytes + sum(r.delta_bytes for r in regions or [])
        shares = self.kept_shares([r.name for r in regions or []])
        unit_of = {m.name: u[0].name for u in self._units() for m in u}
        for item in self.items:
            j = item.index(chosen[item.name])
            for c in criteria:
                totals[c] += item.mean(c)[j]
            # A recomputed region's items are rerun in backward: their storage is that backward's transient.
            kept = item.nbytes[j] * shares[unit_of[item.name]]
            if item.group is None:
                nbytes += kept
            else:  # a shared input keeps each distinct option once
                group_options[(item.group, item.options[j])] = kept
        nbytes += sum(group_options.values())
        return {**totals, "loss_change": abs(totals["loss_change"]),
                "cosine": totals["cosine"] / max(len(self.items), 1), "bytes": float(nbytes),
                "ratio": nbytes / self.stock_bytes, **({"step_ratio": self.step_ratio(regions)} if regions else {})}

    # ---- choosing -------------------------------------------------------------------------------

    def make_map(self, budget: float, criterion: str = DEFAULT_CRITERION,
                 weights: Mapping[str, float] | None = None, max_step_ratio: float = 1.0) -> ScoredPlan:
        """The map of least summed ``criterion`` whose total saved bytes fit ``budget`` (a fraction
        of stock's saved bytes when <= 1, else bytes): a multiple-choice knapsack over the whole
        menu, the layers reading one tensor choosing together. ``weights``: item name -> factor on
        its criterion values (default 1), how a search tells the knapsack which layers to trust
        more or less than the criterion does; the score returned is the unweighted one.
        ``max_step_ratio`` > 1: regions recomputed too where that lowers the criterion, their
        predicted step within that many stock steps (``recompute_ladder``)."""
        if criterion not in CRITERIA:
            raise ValueError(f"unknown criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")
        if criterion not in self.criteria:
            raise ValueError(f"this menu was measured without criterion {criterion!r} (have "
                             f"{', '.join(self.criteria)}); measure it again to use it")
        if budget <= 0:
            raise ValueError(f"budget must be > 0, got {budget}")
        limit = budget * self.stock_bytes if budget <= 1 else float(budget)
        best: tuple[float, dict[str, str], list[RecomputeOption]] | None = None
        for regions in self.recompute_ladder(max_step_ratio):
            found = self._knapsack(limit, criterion, weights, regions)
            if found is not None and (best is None or found[0] < min((1 - MIN_GAIN) * best[0], best[0] - MIN_ABS_GAIN)):
                best = (*found, regions)
        if best is None:
            raise ValueError(f"no map fits {limit / self.stock_bytes:.3f}x stock saved bytes; the menu's "
                             f"smallest is {self.least_ratio(max_step_ratio):.3f}x")
        return self.choice_of(best[1], best[2])

    def recompute_ladder(self, max_step_ratio: float = 1.0) -> list[list[RecomputeOption]]:
        """The region sets ``make_map`` tries: none, then one more region at a time, most bytes
        freed per second of rerun first, while the predicted step stays within ``max_step_ratio``."""
        ladder: list[list[RecomputeOption]] = [[]]
        order = sorted((r for r in self.regions if r.freed_bytes > 0), key=lambda r: -r.freed_bytes / max(r.seconds, 1e-9))
        for k in range(1, len(order) + 1):
            if self.step_ratio(order[:k]) > max_step_ratio:
                break
            ladder.append(order[:k])
        return ladder

    def least_bytes(self, max_step_ratio: float = 1.0) -> float:
        """The fewest saved bytes any map reaches, regions recomputed as ``make_map`` would."""
        return min(self._least(regions) for regions in self.recompute_ladder(max_step_ratio))

    def _least(self, regions: list[RecomputeOption]) -> float:
        """The fewest saved bytes with ``regions`` recomputed: every other unit at its smallest option."""
        shares = self.kept_shares([r.name for r in regions])
        return (self.base_bytes + sum(r.delta_bytes for r in regions)
                + sum(min(u[0].nbytes[u[0].index(o)] for o in shared_options(u)) * shares[u[0].name] for u in self._units()))

    def _knapsack(self, limit: float, criterion: str, weights: Mapping[str, float] | None,
                  regions: list[RecomputeOption]) -> tuple[float, dict[str, str]] | None:
        """The least-``criterion`` choice for the items outside ``regions`` within ``limit`` bytes:
        (its weighted value, item -> option), or None."""
        shares = self.kept_shares([r.name for r in regions])
        inside = self._inside(shares)
        units = [u for u in self._units() if u[0].name not in inside]
        fixed = self.base_bytes + sum(r.delta_bytes for r in regions)
        values, costs, unit_options = [], [], []
        for members in units:
            options = shared_options(members)
            unit_options.append(options)
            per_option = [sum(_additive(m, criterion)[m.index(o)] * (weights or {}).get(m.name, 1.0) for m in members)
                          for o in options]
            values.append(per_option)
            costs.append([members[0].nbytes[members[0].index(o)] * shares[members[0].name] for o in options])
        choice = least_value_choice(values, costs, limit - fixed)
        if choice is None:
            return None
        rerun_items = [i for i in self.items if i.name in inside]
        chosen = {i.name: _rerun_option(i) for i in rerun_items}
        rerun = sum(_additive(i, criterion)[i.index(chosen[i.name])] * (weights or {}).get(i.name, 1.0) for i in rerun_items)
        for members, options, j in zip(units, unit_options, choice, strict=True):
            for m in members:
                chosen[m.name] = options[j]
        return rerun + sum(v[j] for v, j in zip(values, choice, strict=True)), chosen

    def choice_of(self, chosen: Mapping[str, str], regions: list[RecomputeOption] | None = None) -> ScoredPlan:
        """The plan giving each item its option in ``chosen`` (item name -> option; items reading
        one tensor must agree) and recomputing ``regions``, and its score. Exact companions on: the
        menu's bytes assume them."""
        joint = {i.name: (str(i.partner), *split_joint(chosen[i.name])) for i in self.items if i.kind == JOINT_KIND}
        conv = {i.name: chosen[i.name] for i in self.items if i.kind in MAP_KINDS}
        conv |= {name: conv_option for name, (_, _, conv_option) in joint.items()}
        norm = {i.name: chosen[i.name] for i in self.items if i.kind == "norm" and chosen[i.name] != "native"}
        norm |= {bn: storage for bn, storage, _ in joint.values() if storage != "native"}
        act = {i.name: chosen[i.name] for i in self.items if i.kind == "act" and chosen[i.name] != "native"}
        saved = region_rule({i.name: chosen[i.name] for i in self.items if i.kind == "saved"},
                            {i.name: i.shielded for i in self.items if i.kind == "saved"})
        plan = CompressionPlan(conv, norm or "native", act or "native", saved, exact_companions=True,
                               recompute=tuple(r.name for r in regions or []))
        return ScoredPlan(plan, self._score(chosen, regions))

    def uniform_choice(self, conv: str, norm: str = "native", act: str = "native",
                       saved: str = "native") -> ScoredPlan:
        """One option everywhere (``conv`` as written in a map, e.g. "2/int4"; a storage for the
        BatchNorm, activation and saved-region items), as a map whose bytes the menu predicts exactly."""
        kinds = {"norm": norm, "act": act, "saved": saved}
        chosen = self.options_of(CompressionPlan({"*": conv}))
        for item in self.items:
            if item.kind in kinds:
                chosen[item.name] = kinds[item.kind]
            elif item.kind == JOINT_KIND:
                chosen[item.name] = joint_option(norm, split_joint(chosen[item.name])[1])
            item.index(chosen[item.name])
        return self.choice_of(chosen)

    def uniform(self, conv: str, norm: str = "native", act: str = "native", saved: str = "native") -> dict[str, float]:
        """The score of one option everywhere (``uniform_choice``)."""
        return self.uniform_choice(conv, norm, act, saved).score

    def least_ratio(self, max_step_ratio: float = 1.0) -> float:
        """The smallest saved-bytes ratio to stock any map of this menu reaches (``least_bytes``)."""
        return self.least_bytes(max_step_ratio) / self.stock_bytes

    def unit_items(self) -> dict[str, list[str]]:
        """Units that choose one option together, named by their first item -> their items."""
        return {members[0].name: [m.name for m in members] for members in self._units()}

    def _units(self) -> list[list[MenuItem]]:
        """Items that choose together: one conv group, or a single norm / activation / region item."""
        groups: dict[Any, list[MenuItem]] = {}
        for item in self.items:
            key = ("group", item.group) if item.group is not None else ("item", item.name)
            groups.setdefault(key, []).append(item)
        return list(groups.values())

    # ---- files ----------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for item in self.items:
            means = {c: item.mean(c) for c in self.criteria}
            for j, option in enumerate(item.options):
                out.append({"item": item.name, "kind": item.kind, "option": option, "bytes": item.nbytes[j],
                            **{c: means[c][j] for c in means}})
        exact = {c: 1.0 if c == "cosine" else 0.0 for c in self.criteria}
        out += [{"item": r.name, "kind": "recompute", "option": f"recompute ({r.seconds * 1e3:.1f} ms)",
                 "bytes": r.delta_bytes, **exact} for r in self.regions]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"stock_bytes": self.stock_bytes, "base_bytes": self.base_bytes, "meta": self.meta,
                "items": [asdict(i) for i in self.items], **({"regions": [asdict(r) for r in self.regions]}
                                                              if self.regions else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MenuResult:
        return cls([MenuItem(**i) for i in d["items"]], int(d["stock_bytes"]), int(d["base_bytes"]),
                   dict(d.get("meta", {})), [RecomputeOption(**r) for r in d.get("regions", [])])

    @classmethod
    def load(cls, path: str | Path) -> MenuResult:
        path = Path(path)
        if path.is_dir():
            path = path / "menu.json"
        if not path.is_file():
            raise FileNotFoundError(f"no menu measurement at {path} (lessmem-sensitivity writes it)")
        return cls.from_dict(json.loads(path.read_text()))

    def save(self, out_dir: str | Path, heatmap: bool = True) -> dict[str, Path]:
        """Write menu.json (everything), menu.csv (per item x option: bytes, mean criteria) and
        menu.png (the whole-gradient error of every option)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "menu.json", "csv": out / "menu.csv"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1))
        rows = self.rows()
        with paths["csv"].open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        if heatmap:
            title = (f"{self.meta.get('model', 'model')} ({self.meta.get('weights', '')}): whole-gradient error "
                     f"of each option, {self.meta.get('batches', '?')} batches")
            paths["png"] = plot_menu(self.items, out / "menu.png", title)
        return paths


def _rerun_option(item: MenuItem) -> str:
    """The option a recomputed region's ``item`` stores for its rerun's backward: ``RERUN_STORAGE``
    (with its BatchNorm's for a BatchNorm x conv item) where offered, else its exact option."""
    option = joint_option(RERUN_STORAGE, RERUN_STORAGE) if item.kind == JOINT_KIND else RERUN_STORAGE
    return option if option in item.options else item.exact_option


def _additive(item: MenuItem, criterion: str) -> list[float]:
    """Per option, the value a knapsack sums for ``criterion`` (least is best)."""
    means = item.mean(criterion)
    if criterion == "cosine":
        return [1.0 - v for v in means]  # least summed (1 - cos) = greatest mean cosine
    if criterion == "loss_change":
        return [abs(v) for v in means]
    return means


def _conv_rule(mapping: Mapping[str, Any]) -> dict[str, str]:
    """A conv map's patterns -> option names (``parse_spec`` reads every value form)."""
    rule = {}
    for pattern, value in mapping.items():
        spec = parse_spec(str(pattern), value)
        if spec.kernel[0] != spec.kernel[1]:
            raise ValueError(f"pattern {pattern!r}: the menu measures square kernels only, got {spec.kernel}")
        rule[str(pattern)] = option_name(spec.kernel[0], spec.storage)
    return rule


def _storage_rule(rule: StorageRule) -> dict[str, str]:
    """Patterns -> the menu's option names; ``chunked`` BatchNorm keeps the native input (its
    bytes and gradients are native's: only its backward's scratch is smaller)."""
    rule = {"*": rule} if isinstance(rule, str) else {str(p): str(s) for p, s in rule.items()}
    return {p: "native" if s == CHUNKED else s for p, s in rule.items()}
