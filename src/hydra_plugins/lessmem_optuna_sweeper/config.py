"""The ``hydra/sweeper=lessmem_optuna`` config group option. Hydra imports this module on every
start to discover plugins, so it stays light: no Optuna here. No ``from __future__ import
annotations`` either: Hydra runs this module before it is in sys.modules, where dataclasses look
up string annotations."""

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore


@dataclass
class LessmemOptunaSweeperConf:
    _target_: str = (
        "hydra_plugins.lessmem_optuna_sweeper.lessmem_optuna_sweeper.LessmemOptunaSweeper"
    )
    # Trials in total, counting the study's earlier completed or failed ones (a rerun resumes).
    n_trials: int = 20
    # Trials launched together through the configured launcher (asked before any is told).
    n_jobs: int = 1
    sampler: str = "tpe"  # tpe | random | grid (choice and range sweeps only)
    seed: int | None = None  # sampler seed
    direction: str = "maximize"  # minimize | maximize, the single objective's
    directions: list[str] | None = None  # one per objective: replaces `direction`
    # Names of the objectives, one per direction: a task returning a mapping is read at these
    # keys, a sequence is taken in this order, a number is the one objective.
    objectives: list[str] = field(default_factory=lambda: ["final_top1"])
    # null: in memory. An RDB URL (sqlite:///sweep.db) or a journal file path keeps the study,
    # so the same command with the same study_name resumes it.
    storage: str | None = None
    study_name: str | None = None
    # Search space as key: sweep (choice(a,b), range(1,5), interval(0.1,1), tag(log,interval(..))),
    # extended and overridden by the command line's sweeps.
    params: dict[str, str] | None = None


ConfigStore.instance().store(
    group="hydra/sweeper",
    name="lessmem_optuna",
    node=LessmemOptunaSweeperConf,
    provider="lessmem_optuna_sweeper",
)
