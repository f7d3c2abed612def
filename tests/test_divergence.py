"""A non-finite loss or gradient ends a run at that step, before the optimizer applies it, and the
run's metrics, log and reports say where (classification and language model alike)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

import lessmem.experiment.train as train_mod
from lessmem.experiment.train import run
from lessmem.reporting.rows import row_from
from lessmem.reporting.tables import markdown_table


def test_infinite_lr_stops_at_first_nonfinite_loss(compose, tiny, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        metrics = run(compose(*tiny, "epochs=3", "optimizer.lr=inf", f"out_dir={out}"))
    # Step 1 applies lr=inf: the weights turn non-finite and step 2's loss is NaN.
    assert metrics["diverged"] == {"in": "loss", "epoch": 1, "step": 2, "global_step": 2, "loss": pytest.approx(math.nan,
                                   nan_ok=True)}
    assert metrics["epochs"] == 1 and len(metrics["history"]) == 1  # epochs 2 and 3 never ran
    assert metrics["history"][0]["diverged"] == metrics["diverged"]
    assert math.isnan(metrics["final_train_loss"])
    assert json.loads((out / "metrics.json").read_text())["diverged"]["step"] == 2
    assert not (out / "checkpoint.pt").exists()  # resuming would only diverge again
    assert "training diverged: non-finite loss at epoch 1, step 2" in caplog.text


def test_nonfinite_gradient_is_never_applied(compose, tiny_lm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = train_mod.train_step
    before: dict[str, torch.Tensor] = {}
    nets = []

    def poisoned(state, spec, x, y):
        nets.append(state.net)
        before.update({n: p.detach().clone() for n, p in state.net.named_parameters()})
        loss, logits, x, y = step(state, spec, x, y)
        next(p for p in state.net.parameters() if p.grad is not None).grad[0] = math.inf
        return loss, logits, x, y

    monkeypatch.setattr(train_mod, "train_step", poisoned)
    metrics = run(compose(*tiny_lm, f"out_dir={tmp_path / 'lm'}"))
    assert metrics["diverged"]["in"] == "gradient" and metrics["diverged"]["step"] == 1
    assert math.isfinite(metrics["diverged"]["loss"]) and math.isfinite(metrics["final_val_ppl"])
    assert len(nets) == 1 and all(torch.equal(p, before[n]) for n, p in nets[0].named_parameters())
    row = row_from(compose(*tiny_lm), metrics)
    assert "(diverged: epoch 1, step 1)" in markdown_table([row])


def test_search_report_never_picks_a_diverged_trial(tmp_path: Path) -> None:
    import optuna
    from omegaconf import OmegaConf

    from lessmem.search.report import write_report

    study = optuna.create_study(direction="maximize")
    for number, (value, diverged) in enumerate([(0.9, {"epoch": 1, "step": 3}), (0.5, None)]):
        map_file = tmp_path / f"map{number}.yaml"
        map_file.write_text(f"map: {{'*': {number + 2}}}\n")
        attrs = {"seed": "knapsack" if number == 0 else "tpe", "ratio": 0.3, "criterion": 0.1, "score": value,
                 "map_file": str(map_file), **({"diverged": diverged} if diverged else {})}
        study.add_trial(optuna.trial.create_trial(value=value, user_attrs=attrs))
    search = OmegaConf.create({"out_dir": str(tmp_path), "study_name": "t", "direction": "maximize",
                               "score_key": "best_top1", "budget": 0.4, "criterion": "tensor_error",
                               "pruner": {"name": "none"}})
    summary = write_report(study, search)
    assert summary["best"]["trial"] == 1 and summary["diverged_trials"] == 1 and summary["complete_trials"] == 1
    assert (tmp_path / "best_map.yaml").read_text() == (tmp_path / "map1.yaml").read_text()
    report = (tmp_path / "report.md").read_text()
    assert "| 0 | knapsack | diverged (epoch 1, step 3) |" in report and "1 diverged (never the best)" in report
    assert report.index("| 0 | knapsack") < report.index("| 1 | tpe")  # best score first
    search.direction = "minimize"  # val_ppl: the lowest first
    write_report(study, search)
    report = (tmp_path / "report.md").read_text()
    assert report.index("| 1 | tpe") < report.index("| 0 | knapsack")
