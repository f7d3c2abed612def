"""lessmem.search: resumable Optuna search over compression maps (tiny, synthetic data)."""

from __future__ import annotations

import json

import optuna
import pytest
import yaml
from PIL import Image

from lessmem.search import load_sweep, open_study, run_search

BASE = ["model=resnet20", "dataset=synthetic", "dataset.size=64", "dataset.val_size=32",
        "logger=disabled", "device=cpu"]


def sweep(tmp_path, **over):
    args = {"study_name": "t", "out_dir": str(tmp_path / "s"), "n_trials": 3, "population_size": 4,
            "kernels": [1, 2, 4], "groups": ["conv1", "layer1.*", "layer2.*", "layer3.*"],
            "sensitivity": {"batches": 1, "batch_size": 8}, **over}
    dotlist = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in args.items()]
    return load_sweep(None, [*dotlist, f"base_overrides={json.dumps(BASE)}"])


def test_interrupted_search_resumes(tmp_path) -> None:
    first = run_search(sweep(tmp_path, n_trials=2))
    assert first["complete_trials"] == 2
    study = open_study(sweep(tmp_path), tmp_path / "s" / "study.journal")
    before = {t.number: t.params for t in study.trials if t.state.is_finished()}
    study.ask()  # a trial left RUNNING, as if the process had been killed mid-trial
    summary = run_search(sweep(tmp_path, n_trials=3))
    study = open_study(sweep(tmp_path), tmp_path / "s" / "study.journal")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert summary["complete_trials"] == 3 and len(complete) == 3
    assert {t.number: t.params for t in complete if t.number in before} == before  # not repeated
    assert [t.state for t in study.trials].count(optuna.trial.TrialState.FAIL) == 1
    # The stale trial had taken the queued uniform_4 seed; it went back to the end of the queue.
    seeds = [t.user_attrs.get("seed") for t in complete]
    assert seeds == ["uniform_1", "uniform_2", "sensitivity"]
    assert [t.user_attrs.get("seed") for t in study.trials if t.state.name == "WAITING"] == ["uniform_4"]
    u1, u2 = summary["seeds"]["uniform_1"], summary["seeds"]["uniform_2"]
    assert u1["score"] == pytest.approx(1.0) and u2["score"] < 1
    assert u2["conv_input_bytes"] < u1["conv_input_bytes"]
    # A fourth run with the same n_trials does nothing new.
    assert run_search(sweep(tmp_path, n_trials=3))["complete_trials"] == 3

    out = tmp_path / "s"
    for name in ("trials.csv", "pareto.csv", "pareto.md", "summary.json", "sensitivity/sensitivity.png"):
        assert (out / name).is_file(), name
    for png in (out / "pareto.png", out / "sensitivity" / "sensitivity.png"):
        with Image.open(png) as im:
            im.verify()
    maps = list((out / "best_maps").glob("*.yaml"))
    assert maps and "map" in yaml.safe_load(maps[0].read_text())
    trial_cfg = yaml.safe_load((out / "trials" / "0001" / "config.yaml").read_text())
    assert set(trial_cfg["compression"]["map"].values()) == {2}
    assert trial_cfg["model"]["name"] == "resnet20"


def test_budget_mode_and_accuracy_objective(tmp_path) -> None:
    """Single objective under a memory budget; each trial trains via train.run (1 tiny epoch)."""
    s = sweep(tmp_path, n_trials=1, mode="budget", objective="accuracy", budget=0.3,
              base_overrides=None)
    s.base_overrides = [*BASE, "epochs=1", "batch_size=32", "eval_batch_size=32", "memory_batch=4"]
    summary = run_search(s)
    assert summary["complete_trials"] == 1
    assert 0.0 <= summary["seeds"]["uniform_1"]["score"] <= 1.0
    assert summary["best_feasible"] is None  # uniform_1 keeps all bytes: over the 0.3 budget
    assert (tmp_path / "s" / "trials" / "0000" / "train" / "metrics.json").is_file()


class _PruneFromTrial1(optuna.pruners.BasePruner):
    """Prunes every trial but the first at its first report: deterministic, unlike the median."""

    def prune(self, study, trial) -> bool:
        return trial.number >= 1


def _pruning_sweep(tmp_path, monkeypatch, epochs: int):
    """Two accuracy trials of ``epochs`` tiny epochs under a pruner that prunes trial 1 at once."""
    import lessmem.search.study as study_module

    monkeypatch.setattr(study_module, "make_pruner", lambda pcfg: _PruneFromTrial1())
    s = sweep(tmp_path, n_trials=2, mode="budget", objective="accuracy", budget=0.3,
              base_overrides=None, pruner={"name": "median"})
    s.base_overrides = [*BASE, f"epochs={epochs}", "batch_size=32", "eval_batch_size=32", "memory_batch=4"]
    return s


def test_accuracy_search_prunes_per_epoch(tmp_path, monkeypatch) -> None:
    s = _pruning_sweep(tmp_path, monkeypatch, epochs=2)
    summary = run_search(s)
    assert summary["complete_trials"] == 1 and summary["pruned_trials"] == 1
    study = open_study(s, tmp_path / "s" / "study.journal")
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert len(pruned) == 1 and list(pruned[0].intermediate_values) == [1]
    # The pruned run stopped after its first epoch, with that epoch checkpointed.
    lines = (tmp_path / "s" / "trials" / "0001" / "train" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    full = (tmp_path / "s" / "trials" / "0000" / "train" / "metrics.jsonl").read_text().splitlines()
    assert len(full) == 2
    rows = (tmp_path / "s" / "trials.csv").read_text()
    assert "pruned" in rows and "Pruned trials" in (tmp_path / "s" / "pareto.md").read_text()


@pytest.mark.slow
def test_a_trial_is_never_pruned_after_its_last_epoch(tmp_path, monkeypatch) -> None:
    """Pruning then saves nothing and would only throw a finished score away."""
    summary = run_search(_pruning_sweep(tmp_path, monkeypatch, epochs=1))
    assert summary["complete_trials"] == 2 and summary["pruned_trials"] == 0


def test_pruner_choices() -> None:
    from lessmem.search import make_pruner

    base = {"n_startup_trials": 2, "n_warmup_steps": 1, "min_resource": 1, "reduction_factor": 3}
    assert isinstance(make_pruner({"name": "median", **base}), optuna.pruners.MedianPruner)
    assert isinstance(make_pruner({"name": "hyperband", **base}), optuna.pruners.HyperbandPruner)
    assert isinstance(make_pruner({"name": "none", **base}), optuna.pruners.NopPruner)
    with pytest.raises(ValueError, match="pruner.name"):
        load_sweep(None, ["pruner.name=asha"])
    with pytest.raises(ValueError, match="multi-objective"):
        load_sweep(None, ["pruner.name=median", "objective=accuracy", "mode=pareto"])


def _menu_sweep(tmp_path, **over):
    """A menu search of resnet20 on synthetic data; the menu measured on the run's memory batch."""
    import torch

    from lessmem.experiment import build_model_from_cfg, compose_config
    from lessmem.experiment.data import fixed_batches
    from lessmem.layer_sensitivity import measure_menu

    base = [*BASE, "epochs=1", "batch_size=32", "eval_batch_size=32", "memory_batch=4"]
    cfg = compose_config(base)
    torch.manual_seed(0)
    menu = measure_menu(build_model_from_cfg(cfg).train(), fixed_batches(cfg, 1, 4), kernels=(1, 2, 4),
                        storages=("native", "int8", "int4"), norm_storages=("int8", "int4"), act_storages=())
    menu_path = tmp_path / "menu"
    menu.save(menu_path, heatmap=False)
    s = sweep(tmp_path, space="menu", menu=str(menu_path / "menu.json"), objective="accuracy", mode="budget",
              criterion="grad_error", base_overrides=None, **over)
    s.base_overrides = base
    return s, menu


def test_menu_search_trains_knapsack_variations_within_budget(tmp_path, monkeypatch) -> None:
    """space=menu: trial 0 is the criterion's own map, every trial's map fits the budget (its bytes
    predicted exactly: equal to the run's measured saved bytes), a map met again is not retrained,
    and the best map is a file a run can use."""
    from lessmem.search.menu_objective import MenuObjective, weight_param

    s, menu = _menu_sweep(tmp_path, n_trials=3, budget=0.4)
    # A second seed scaling every unit alike: the same knapsack answer, so trained once only.
    seeds = MenuObjective.seeds
    monkeypatch.setattr(MenuObjective, "seeds", lambda self: {
        **seeds(self), "scaled": {weight_param(u): 0.5 for u in self.units}})
    summary = run_search(s)
    assert summary["complete_trials"] == 3 and summary["knapsack"]["trial"] == 0
    study = open_study(s, tmp_path / "s" / "study.journal")
    trials = sorted(study.trials, key=lambda t: t.number)
    chosen = menu.make_map(0.4, "grad_error")
    knapsack = yaml.safe_load((tmp_path / "s" / "trials" / "0000" / "compression.yaml").read_text())
    assert {k: str(v) for k, v in knapsack["map"].items()} == chosen.map
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
    from lessmem.experiment import compose_config
    from lessmem.experiment.compression import resolve_compression

    best = resolve_compression(compose_config([*BASE, f"compression.map_file={out / 'best_map.yaml'}"]).compression)
    assert best.exact_companions and best.map


def test_menu_search_config_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="space=menu needs menu="):
        load_sweep(None, ["space=menu", "objective=accuracy", "mode=budget"])
    menu = tmp_path / "menu.json"
    menu.write_text("{}")
    with pytest.raises(ValueError, match="objective=accuracy and mode=budget"):
        load_sweep(None, ["space=menu", f"menu={menu}"])
    with pytest.raises(ValueError, match="criterion must be one of"):
        load_sweep(None, ["space=menu", f"menu={menu}", "objective=accuracy", "mode=budget", "criterion=top1"])
    with pytest.raises(ValueError, match="space must be"):
        load_sweep(None, ["space=stages"])
