"""The sensitivity and coverage commands in-process: their own ``<command>.KEY=VALUE`` options,
and a misspelled one ends with one ``<prog>: error:`` line and exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lessmem.cli import coverage, sensitivity

BASE = ["model=resnet20", "dataset=synthetic", "dataset.size=16", "device=cpu"]


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("arg", ["sensitivity.batchez=2", "+sensitivity.kernelz=[1]"])
def test_sensitivity_misspelled_option(arg: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert sensitivity.main([*BASE, arg]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"lessmem-sensitivity: error: unknown option {arg!r}")
    assert "sensitivity.* options: batch_size, batches" in line


def test_sensitivity_option_without_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert sensitivity.main([*BASE, "sensitivity.budget"]) == 2
    assert one_error_line(capsys) == ("lessmem-sensitivity: error: option 'sensitivity.budget' needs a value: "
                                      "sensitivity.budget=VALUE")


def test_coverage_misspelled_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert coverage.main([*BASE, "coverage.bach=2"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("lessmem-coverage: error: unknown option 'coverage.bach=2'")


def test_sensitivity_options_reach_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = tmp_path / "weights.pt"
    torch.manual_seed(0)
    from lessmem.models import build_model

    torch.save(build_model("resnet20", 10).state_dict(), weights)
    out = tmp_path / "out"
    assert sensitivity.main([*BASE, "sensitivity.batches=1", "sensitivity.batch_size=4", "sensitivity.kernels=[1, 2]",
                             f"sensitivity.checkpoint={weights}", f"sensitivity.out={out}"]) == 0
    assert "kernels: [1, 2]" in capsys.readouterr().out
    assert (out / "sensitivity.json").is_file() and (out / "sensitivity_resnet20.yaml").is_file()
