"""The sensitivity and coverage commands in-process: their ``<command>.*`` Hydra settings (and
the ``menu`` group) reach the run, and a misspelled one ends with one ``<prog>: error:`` line and exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lessmem.cli import coverage, sensitivity
from lessmem.sensitivity import MenuResult


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def exit_status(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_sensitivity_misspelled_option(capsys: pytest.CaptureFixture[str], tiny: tuple[str, ...]) -> None:
    assert exit_status(sensitivity.main, [*tiny, "sensitivity.batchez=2"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("lessmem-sensitivity: error: Could not override 'sensitivity.batchez'")
    assert "not in struct" in line


def test_sensitivity_option_without_value(capsys: pytest.CaptureFixture[str], tiny: tuple[str, ...]) -> None:
    assert exit_status(sensitivity.main, [*tiny, "sensitivity.budget"]) == 2
    assert one_error_line(capsys).startswith("lessmem-sensitivity: error: Error parsing override "
                                             "'sensitivity.budget'; missing EQUAL")


def test_coverage_misspelled_option(capsys: pytest.CaptureFixture[str], tiny: tuple[str, ...]) -> None:
    assert exit_status(coverage.main, [*tiny, "coverage.bach=2"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("lessmem-coverage: error: Could not override 'coverage.bach'")


def test_sensitivity_options_reach_the_run(tmp_path: Path, tiny: tuple[str, ...]) -> None:
    weights = tmp_path / "weights.pt"
    torch.manual_seed(0)
    from lessmem.models import build_model

    torch.save(build_model("resnet20", 10).state_dict(), weights)
    out = tmp_path / "out"
    assert sensitivity.main([*tiny, "sensitivity.batches=1", "sensitivity.batch_size=4", "menu.kernels=[1, 2]",
                             f"sensitivity.checkpoint={weights}", f"sensitivity.out={out}"]) == 0
    meta = MenuResult.load(out).meta
    assert meta["kernels"] == [1, 2] and (meta["batches"], meta["batch_size"], meta["weights"]) == (1, 4, str(weights))
    assert (out / "menu.json").is_file() and (out / "menu_resnet20.yaml").is_file()
