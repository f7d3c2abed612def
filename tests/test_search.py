"""lessmem.search: resumable Optuna search over menu maps (tiny, synthetic data)."""

from __future__ import annotations

import json
import sys

import optuna
import pytest
import torch
import yaml
from PIL import Image

from lessmem.experiment import compose_config, model_spec
from lessmem.experiment.data import fixed_batches
from lessmem.search import check_criterion, run_search
from lessmem.search.run import check_search, open_search_study
from lessmem.sensitivity import MenuOptions, measure_menu


@pytest.fixture
def base(tiny: tuple[str, ...]) -> list[str]:
    """The stock tiny run each trial's map goes on top of."""
    return [*tiny, "compression=none"]


def search_cfg(tmp_path, base: list[str], *over: str):
    """A search config composed as lessmem-search composes it (conf/search.yaml)."""
    return compose_config(["study_name=t", f"out_dir={tmp_path / 's'}", "n_trials=3", "budget=0.4",
                           "criterion=grad_error", f"base_overrides={json.dumps(base)}", *over], "search")


def menu_file(tmp_path, base: list[str]):
    cfg = compose_config(base)
    torch.manual_seed(0)
    options = MenuOptions(kernels=(1, 2, 4), storages=("native", "int8", "int4"), norm_storages=("int8", "int4"),
                          act_storages=())
    menu = measure_menu(model_spec(cfg.model).build().train(), fixed_batches(cfg, 1, 4), options)
    menu.save(tmp_path / "menu", heatmap=False)
    return menu, tmp_path / "menu" / "menu.json"


def test_menu_search_trains_knapsack_variations_within_budget(tmp_path, monkeypatch, base) -> None:
    """Trial 0 is the criterion's own map, every trial's map fits the budget (its bytes predicted
    exactly: equal to the run's measured saved bytes), a map met again is not retrained, the best
    map is a file a run can use, and a rerun with a trial left RUNNING resumes the same study."""
    from lessmem.search.objective import Objective, weight_param

    menu, path = menu_file(tmp_path, base)
    s = search_cfg(tmp_path, base, f"menu_file={path}")
    # A second seed scaling every unit alike: the same knapsack answer, so trained once only.
    seeds = Objective.seeds
    monkeypatch.setattr(Objective, "seeds", lambda self: {
        **seeds(self), "scaled": {weight_param(u): 0.5 for u in self.units}})
    summary = run_search(s)
    assert summary["complete_trials"] == 3 and summary["knapsack"]["trial"] == 0
    study, created = open_search_study(s)
    assert not created
    trials = sorted(study.trials, key=lambda t: t.number)
    chosen = menu.make_map(0.4, "grad_error")
    knapsack = yaml.safe_load((tmp_path / "s" / "trials" / "0000" / "compression.yaml").read_text())
    assert {k: str(v) for k, v in knapsack["map"].items()} == chosen.plan.map
    assert trials[1].user_attrs["same_as"] == 0 and trials[1].value == trials[0].value
    assert not (tmp_path / "s" / "trials" / "0001" / "train").exists()
    for t in trials:
        assert t.user_attrs["ratio"] <= 0.4
    for t in (trials[0], trials[2]):
        measured = t.user_attrs["measured_saved_bytes"] / t.user_attrs["stock_saved_bytes"]
        assert measured == pytest.approx(t.user_attrs["ratio"])
    out = tmp_path / "s"
    for name in ("trials.csv", "report.md", "summary.json", "best_map.yaml"):
        assert (out / name).is_file(), name
    with Image.open(out / "search.png") as im:
        im.verify()
    best = compose_config([*base, f"compression.map_file={out / 'best_map.yaml'}"])
    assert best.compression.map_file
    # Resume: a trial left RUNNING (a killed process) fails, its params run again; done trials stay.
    study.ask({weight_param(u): optuna.distributions.FloatDistribution(-2, 2) for u in menu.unit_items()})
    summary = run_search(search_cfg(tmp_path, base, f"menu_file={path}", "n_trials=4"))
    study, _ = open_search_study(s)
    states = [t.state for t in study.trials]
    assert summary["complete_trials"] == 4 and states.count(optuna.trial.TrialState.FAIL) == 1


def test_search_config_errors(tmp_path, base) -> None:
    with pytest.raises(ValueError, match="unknown criterion 'top1'"):
        check_criterion("top1")
    with pytest.raises(ValueError, match=r"budget is a fraction of stock saved bytes in \(0, 1\]"):
        check_search(search_cfg(tmp_path, base, "budget=2"))
    with pytest.raises(FileNotFoundError, match="menu_file .* does not exist"):
        check_search(search_cfg(tmp_path, base, f"menu_file={tmp_path / 'none.json'}"))
    with pytest.raises(ValueError, match="pruner.name must be one of"):
        check_search(search_cfg(tmp_path, base, "pruner.name=asha"))


def test_search_without_a_config_is_a_usage_error(monkeypatch, capsys) -> None:
    from lessmem.cli import search

    monkeypatch.setattr(sys, "argv", ["lessmem-search"])
    with pytest.raises(SystemExit) as exit_:
        search.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lessmem-search: error: no search config")


def test_search_command_runs_a_sweeps_config(tmp_path, run_cli, base) -> None:
    """``lessmem-search -cd sweeps -cn menu_resnet20`` as documented, on tiny data: the sweep's own
    menu file, criterion, score and pruner; everything lands in its run dir. A budget below the menu's
    smallest map is one error line before any trial."""
    from pathlib import Path

    from lessmem.cli import search

    repo = Path(__file__).parents[1]
    cmd = ["-cd", str(repo / "sweeps"), "-cn", "menu_resnet20", "n_trials=1",
           f"menu_file={repo / 'docs/results/criterion_check/menu/menu.json'}", f"base_overrides={json.dumps(base)}"]
    result = run_cli(search.main, "lessmem-search", *cmd, f"hydra.run.dir={tmp_path / 's'}")  # out_dir= below
    assert result.status == 0, result.stderr
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert (tmp_path / "s" / "study.journal").is_file() and (tmp_path / "s" / "search.log").is_file()
    assert summary["complete_trials"] == 1 and summary["knapsack"]["trial"] == 0
    assert (summary["criterion"], summary["score_key"], summary["pruner"]) == ("grad_error", "final_top1", "median")
    assert summary["knapsack"]["ratio"] <= summary["budget"] == 0.547
    result = run_cli(search.main, "lessmem-search", *cmd, "budget=0.01", f"out_dir={tmp_path / 'small'}")
    assert result.is_one_error("lessmem-search", "no map fits 0.010x stock saved bytes"), result
    assert not (tmp_path / "small" / "study.journal").exists()
