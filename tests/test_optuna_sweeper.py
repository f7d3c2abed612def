"""hydra/sweeper=lessmem_optuna: the plugin's search space and objectives, and Optuna sweeps of
lessmem-train run in this process on tiny synthetic data (multi- and single-objective, resume,
a failing trial)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from hydra_plugins.lessmem_optuna_sweeper._objectives import objective_values
from hydra_plugins.lessmem_optuna_sweeper._search_space import parse_search_space
from hydra_plugins.lessmem_optuna_sweeper._settings import SweepSettings
from lessmem.cli.train import train_main

SPACE = {"compression": CategoricalDistribution(["pool2", "pool4"]),
         "optimizer.lr": FloatDistribution(0.01, 0.3, log=True)}


@pytest.fixture(autouse=True)
def _fresh_hydra() -> Iterator[None]:
    yield
    GlobalHydra.instance().clear()  # the sweep leaves Hydra initialized in this process


@pytest.fixture
def sweep(monkeypatch: pytest.MonkeyPatch, tiny: tuple[str, ...]) -> Callable[..., dict]:
    """``sweep(sweep_dir, *args)``: ``lessmem-train -m hydra/sweeper=lessmem_optuna`` on ``tiny`` in
    this process; the results file."""

    def run(sweep_dir: Path, *args: str) -> dict:
        monkeypatch.setattr(sys, "argv", ["lessmem-train", "-m", "hydra/sweeper=lessmem_optuna", *tiny,
                                          f"hydra.sweep.dir={sweep_dir}", *args])
        train_main()
        return yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())

    return run


def _run_of(trial: FrozenTrial) -> tuple[dict, dict]:
    """The trial's Hydra job: its composed config and its metrics."""
    out = Path(trial.user_attrs["output_dir"])
    return yaml.safe_load((out / "config.yaml").read_text()), json.loads((out / "metrics.json").read_text())


def _assert_ran_with_sampled_values(trial: FrozenTrial) -> dict:
    config, metrics = _run_of(trial)
    assert config["compression"]["name"] == trial.params["compression"] == metrics["compression"]
    assert config["optimizer"]["lr"] == pytest.approx(trial.params["optimizer.lr"])
    return metrics


def _dominates(a: list[float], b: list[float]) -> bool:  # maximize a[0], minimize a[1]
    return a[0] >= b[0] and a[1] <= b[1] and (a[0] > b[0] or a[1] < b[1])


def test_multi_objective_sweep_resumes_its_study(sweep: Callable[..., dict], tmp_path: Path) -> None:
    journal = tmp_path / "study.journal"
    common = ["hydra.sweeper.sampler=random", "hydra.sweeper.seed=0", "hydra.sweeper.n_jobs=2",
              "hydra.sweeper.directions=[maximize,minimize]", "hydra.sweeper.objectives=[final_top1,ratio]",
              f"hydra.sweeper.storage={journal}", "hydra.sweeper.study_name=mo",
              "compression=choice(pool2,pool4)", "optimizer.lr=tag(log,interval(0.01,0.3))"]
    results = sweep(tmp_path / "first", *common, "hydra.sweeper.n_trials=3")

    study = optuna.load_study(study_name="mo", storage=JournalStorage(JournalFileBackend(str(journal))))
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == len(study.trials) == 3
    for trial in complete:
        metrics = _assert_ran_with_sampled_values(trial)
        assert trial.values == pytest.approx([metrics["final_top1"], metrics["ratio"]])

    front = results["solutions"]
    assert results["objectives"] == ["final_top1", "ratio"] and results["n_complete"] == 3
    assert {s["trial"] for s in front} == {t.number for t in study.best_trials}
    for s in front:
        assert s["values"] == pytest.approx(study.trials[s["trial"]].values)
        assert not any(_dominates(t.values, s["values"]) for t in complete)
    for t in complete:
        if t.number not in {s["trial"] for s in front}:
            assert any(_dominates(s["values"], t.values) for s in front)

    # A sweep killed mid-trial leaves it RUNNING: the rerun fails it and runs its params again.
    left = study.ask(SPACE)
    sweep(tmp_path / "second", *common, "hydra.sweeper.n_trials=4")
    study = optuna.load_study(study_name="mo", storage=JournalStorage(JournalFileBackend(str(journal))))
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 4 and study.trials[left.number].state == TrialState.FAIL
    rerun = complete[-1]
    assert rerun.user_attrs["retry_of"] == left.number and rerun.params == left.params
    _assert_ran_with_sampled_values(rerun)
    assert len(list((tmp_path / "second").glob("*/metrics.json"))) == 1


@pytest.mark.slow
def test_single_objective_sweep_maximizes_final_top1(sweep: Callable[..., dict], tmp_path: Path) -> None:
    db = tmp_path / "study.db"
    results = sweep(tmp_path / "sweep", "hydra.sweeper.n_trials=3", "hydra.sweeper.seed=1",
                     f"hydra.sweeper.storage=sqlite:///{db}", "hydra.sweeper.study_name=so",
                     "optimizer.lr=interval(0.01,0.3)", "compression=choice(pool2,pool4)")
    study = optuna.load_study(study_name="so", storage=f"sqlite:///{db}")
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 3
    top1 = [_assert_ran_with_sampled_values(t)["final_top1"] for t in complete]
    assert [t.value for t in complete] == pytest.approx(top1)  # the default objective
    assert results["best_value"] == pytest.approx(max(top1))
    best_config, best_metrics = _run_of(study.trials[results["best_trial"]])
    assert results["best_params"] == {"optimizer.lr": pytest.approx(best_config["optimizer"]["lr"]),
                                      "compression": best_config["compression"]["name"]}
    assert best_metrics["final_top1"] == pytest.approx(results["best_value"])


def test_a_failing_trial_is_marked_fail_and_the_grid_goes_on(sweep: Callable[..., dict], tmp_path: Path) -> None:
    journal = tmp_path / "study.journal"
    results = sweep(tmp_path / "sweep", "hydra.sweeper.sampler=grid", "hydra.sweeper.n_trials=10",
                     f"hydra.sweeper.storage={journal}", "hydra.sweeper.study_name=grid",
                     "optimizer.lr=choice(0.05,-1.0)")  # SGD refuses a negative lr: ValueError
    study = optuna.load_study(study_name="grid", storage=JournalStorage(JournalFileBackend(str(journal))))
    by_lr = {t.params["optimizer.lr"]: t for t in study.trials}
    assert len(study.trials) == 2  # n_trials capped at the grid's size
    assert by_lr[0.05].state == TrialState.COMPLETE
    assert by_lr[-1.0].state == TrialState.FAIL and "ValueError" in by_lr[-1.0].user_attrs["error"]
    assert results["n_complete"] == 1 and results["n_failed"] == 1
    assert results["best_params"] == {"optimizer.lr": 0.05}


def _space(*overrides: str, grid: bool = False):
    return parse_search_space(overrides, config_loader=None, grid=grid)


def test_search_space_from_overrides() -> None:
    space = _space("a=range(1,5)", "b=tag(log,range(1,9))", "c=range(0.1,0.5,0.1)",
                   "d=tag(log,interval(0.001,1))", "e=interval(0,1)", "+f=choice(x,\"a b\",3,true)",
                   "g=range(10,1,-3)", "seed=3", "+extra=x", "seed=4")
    d = space.distributions
    assert d["a"] == IntDistribution(1, 4)  # range's stop is exclusive, like Hydra's
    assert d["b"] == IntDistribution(1, 8, log=True)
    assert d["c"] == FloatDistribution(0.1, 0.4, step=0.1)
    assert d["d"] == FloatDistribution(0.001, 1.0, log=True) and d["e"] == FloatDistribution(0.0, 1.0)
    assert d["+f"] == CategoricalDistribution(["x", "a\\ b", 3, True])
    assert d["g"] == IntDistribution(4, 10, step=3)
    assert space.fixed == ("+extra=x", "seed=4")  # the later of two overrides of a key wins
    assert space.overrides({"a": 2, "+f": "a\\ b"}) == ("+extra=x", "seed=4", "a=2", "+f=a\\ b")
    parsed = OverridesParser.create().parse_overrides(list(space.overrides({"+f": "a\\ b", "+g": True})))
    assert [o.value() for o in parsed[2:]] == ["a b", True]  # sampled values read back as given
    with pytest.raises(ValueError, match="tag\\(log"):
        _space("x=tag(log,choice(1,2))")


def test_grid_search_space() -> None:
    space = _space("a=range(1,4)", "b=choice(p,q)", "c=5", grid=True)
    assert space.grid() == {"a": [1, 2, 3], "b": ["p", "q"]} and space.grid_size() == 6
    with pytest.raises(ValueError, match="grid sampler"):
        _space("a=interval(0,1)", grid=True)


def test_objective_values_from_a_return() -> None:
    assert objective_values({"final_top1": 0.5, "ratio": 0.25, "x": "y"}, ["ratio", "final_top1"]) == [0.25, 0.5]
    assert objective_values((1, 2), ["a", "b"]) == [1.0, 2.0]
    assert objective_values(0.75, ["final_top1"]) == [0.75]
    with pytest.raises(ValueError, match="no \\['ratio'\\]"):
        objective_values({"final_top1": 0.5}, ["final_top1", "ratio"])
    with pytest.raises(ValueError, match="expected 2"):
        objective_values(0.5, ["a", "b"])
    with pytest.raises(ValueError, match="is nan"):
        objective_values(math.nan, ["loss"])
    with pytest.raises(ValueError, match="not a number"):
        objective_values({"loss": None}, ["loss"])


def test_settings_need_one_objective_per_direction() -> None:
    base = dict(n_trials=2, n_jobs=1, sampler="tpe", seed=None, direction="maximize",
                objectives=["final_top1"], storage=None, study_name=None, params={"x": "choice(1,2)"})
    assert SweepSettings.from_config(**base, directions=None).params == ("x=choice(1,2)",)
    with pytest.raises(ValueError, match="one entry per direction"):
        SweepSettings.from_config(**base, directions=["maximize", "minimize"])
    with pytest.raises(ValueError, match="sampler"):
        SweepSettings.from_config(**{**base, "sampler": "cmaes"}, directions=None)
