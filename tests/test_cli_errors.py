"""The sensitivity and coverage commands in-process: their ``<command>.*`` Hydra settings (and
the ``menu`` group) reach the run, and a misspelled one ends with one ``<prog>: error:`` line and exit status 2."""

from __future__ import annotations

from pathlib import Path

import torch

from lessmem.cli import coverage, sensitivity
from lessmem.sensitivity import MenuResult


def test_sensitivity_misspelled_option(run_cli, tiny: tuple[str, ...]) -> None:
    result = run_cli(sensitivity.main, "lessmem-sensitivity", *tiny, "sensitivity.batchez=2")
    assert result.is_one_error("lessmem-sensitivity", "Could not override 'sensitivity.batchez'"), result
    assert "not in struct" in result.stderr[0]


def test_sensitivity_option_without_value(run_cli, tiny: tuple[str, ...]) -> None:
    result = run_cli(sensitivity.main, "lessmem-sensitivity", *tiny, "sensitivity.budget")
    assert result.is_one_error("lessmem-sensitivity", "Error parsing override 'sensitivity.budget'; missing EQUAL"), result


def test_coverage_misspelled_option(run_cli, tiny: tuple[str, ...]) -> None:
    result = run_cli(coverage.main, "lessmem-coverage", *tiny, "coverage.bach=2")
    assert result.is_one_error("lessmem-coverage", "Could not override 'coverage.bach'"), result


def test_sensitivity_options_reach_the_run(tmp_path: Path, run_cli, tiny: tuple[str, ...]) -> None:
    weights = tmp_path / "weights.pt"
    torch.manual_seed(0)
    from lessmem.models import build_model

    torch.save(build_model("resnet20", 10).state_dict(), weights)
    out = tmp_path / "out"
    result = run_cli(sensitivity.main, "lessmem-sensitivity", *tiny, "sensitivity.batches=1",
                     "sensitivity.batch_size=4", "menu.kernels=[1, 2]", f"sensitivity.checkpoint={weights}",
                     f"sensitivity.out={out}")
    assert result.status == 0, result.stderr
    meta = MenuResult.load(out).meta
    assert meta["kernels"] == [1, 2] and (meta["batches"], meta["batch_size"], meta["weights"]) == (1, 4, str(weights))
    assert (out / "menu.json").is_file() and (out / "menu_resnet20.yaml").is_file()
