"""Hydra overrides -> Optuna search space: ``choice`` (also ``a,b`` and ``glob``) is categorical,
``range`` an int (or stepped float) distribution, ``interval`` a float one; ``tag(log, ...)``
samples on a log scale. Other overrides are passed to every trial unchanged."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

from hydra.core.config_loader import ConfigLoader
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer
from optuna.distributions import (
    BaseDistribution,
    CategoricalChoiceType,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)


@dataclass(frozen=True)
class SearchSpace:
    # Keyed by the override's key as written (with any +/++ prefix): also the Optuna param name.
    distributions: dict[str, BaseDistribution]
    fixed: tuple[str, ...]

    def overrides(self, params: Mapping[str, Any]) -> tuple[str, ...]:
        """One trial's overrides: the fixed ones, then its sampled values."""
        return (*self.fixed, *(f"{key}={value}" for key, value in params.items()))

    def grid(self) -> dict[str, list[CategoricalChoiceType]]:
        """Every sampled key's values, for Optuna's GridSampler (parsed with ``grid=True``)."""
        return {key: list(d.choices) for key, d in self.distributions.items()
                if isinstance(d, CategoricalDistribution)}

    def grid_size(self) -> int:
        return prod(len(values) for values in self.grid().values())


def parse_search_space(overrides: Sequence[str], config_loader: ConfigLoader | None,
                       grid: bool = False) -> SearchSpace:
    """``overrides`` in order, a later one replacing an earlier one of the same key. With
    ``grid`` every sweep becomes the categorical of its values, and intervals are refused."""
    parser = OverridesParser.create(config_loader=config_loader)
    latest: dict[str, Override] = {}
    for override in parser.parse_overrides(list(overrides)):
        latest.pop(override.get_key_element(), None)  # keep the command line's order
        latest[override.get_key_element()] = override
    distributions: dict[str, BaseDistribution] = {}
    fixed: list[str] = []
    for key, override in latest.items():
        if not override.is_sweep_override():
            fixed.append(f"{key}={override.get_value_element_as_str()}")
        elif grid:
            distributions[key] = _grid_distribution(override)
        else:
            distributions[key] = _distribution(override)
    return SearchSpace(distributions, tuple(fixed))


def _choice(value: Any) -> CategoricalChoiceType:
    # Numbers and booleans print back as Hydra reads them; anything else goes as override text.
    return value if isinstance(value, (int, float, bool)) else Transformer.str(value)


def _distribution(override: Override) -> BaseDistribution:
    sweep = override.value()
    log = "log" in sweep.tags
    if isinstance(sweep, IntervalSweep):
        return FloatDistribution(sweep.start, sweep.end, log=log)
    if isinstance(sweep, RangeSweep) and not sweep.shuffle:
        values = list(override.sweep_iterator())
        if not values:
            raise ValueError(f"{override.input_line}: empty range")
        low, high, step = min(values), max(values), abs(sweep.step)
        if all(isinstance(v, int) for v in values):
            return IntDistribution(low, high, log=log, step=step)
        return FloatDistribution(low, high, log=log, step=step)
    if log:
        raise ValueError(f"{override.input_line}: tag(log, ...) needs an interval or a range")
    return CategoricalDistribution([_choice(v) for v in override.sweep_iterator()])


def _grid_distribution(override: Override) -> CategoricalDistribution:
    if not override.is_discrete_sweep():
        raise ValueError(f"{override.input_line}: the grid sampler needs choice or range sweeps")
    return CategoricalDistribution([_choice(v) for v in override.sweep_iterator()])
