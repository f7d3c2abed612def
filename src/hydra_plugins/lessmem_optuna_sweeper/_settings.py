"""The sweeper's settings, checked before any trial runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SAMPLERS = ("tpe", "random", "grid")
DIRECTIONS = ("minimize", "maximize")


@dataclass(frozen=True)
class SweepSettings:
    n_trials: int
    n_jobs: int
    sampler: str
    seed: int | None
    directions: tuple[str, ...]
    objectives: tuple[str, ...]
    storage: str | None
    study_name: str | None
    params: tuple[str, ...]  # hydra.sweeper.params as overrides, before the command line's

    def __post_init__(self) -> None:
        if self.n_trials < 1 or self.n_jobs < 1:
            raise ValueError(f"hydra.sweeper: n_trials ({self.n_trials}) and n_jobs "
                             f"({self.n_jobs}) must be at least 1")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"hydra.sweeper.sampler={self.sampler}: expected one of {', '.join(SAMPLERS)}")
        bad = [d for d in self.directions if d not in DIRECTIONS]
        if bad or not self.directions:
            raise ValueError(f"hydra.sweeper directions {list(self.directions)}: each one of "
                             f"{', '.join(DIRECTIONS)}")
        if len(self.objectives) != len(self.directions):
            raise ValueError(f"hydra.sweeper.objectives {list(self.objectives)} needs one entry per "
                             f"direction {list(self.directions)}")

    @classmethod
    def from_config(cls, *, n_trials: int, n_jobs: int, sampler: str, seed: int | None,
                    direction: str, directions: Sequence[str] | None, objectives: Sequence[str],
                    storage: str | None, study_name: str | None,
                    params: Mapping[str, object] | None) -> SweepSettings:
        return cls(n_trials=n_trials, n_jobs=n_jobs, sampler=sampler, seed=seed,
                   directions=tuple(directions) if directions else (direction,),
                   objectives=tuple(objectives), storage=storage, study_name=study_name,
                   params=tuple(f"{key}={value}" for key, value in (params or {}).items()))

    @property
    def multi_objective(self) -> bool:
        return len(self.directions) > 1
