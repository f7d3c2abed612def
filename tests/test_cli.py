"""The analysis commands in-process.

Where lessmem-coverage, -plan and -sensitivity write: everything (their files, Hydra's ``.hydra/``
and the job's log) into Hydra's run dir, ``hydra.run.dir``; its default is the command's former
``outputs/<command>/...`` location, ``coverage.out`` / ``out_dir`` / ``sensitivity.out`` name the same
directory, and ``-m`` gives each job its own directory under ``hydra.sweep.dir``, as for lessmem-train.

Their ``<command>.*`` Hydra settings (and the ``menu`` group) reach the run, and a misspelled one ends with
one ``<prog>: error:`` line and exit status 2."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lessmem.cli import coverage, plan, sensitivity
from lessmem.sensitivity import MenuResult

MAINS: dict[str, Callable[[], None]] = {
    "lessmem-coverage": coverage.main, "lessmem-plan": plan.main, "lessmem-sensitivity": sensitivity.main,
}
# Each command on tiny inputs (``tiny``: resnet20, synthetic data), and the files it must write; lessmem-plan's
# run (a profile: seconds more) is test_budget.py's test_plan_cli_writes_rows_table_and_plot.
RUNS = {
    "lessmem-coverage": (["coverage.batch=2"], {"coverage.csv", "coverage.json", "coverage.png", "coverage.log"}),
    "lessmem-sensitivity": (["sensitivity.batches=1", "sensitivity.batch_size=2", "menu=kernels", "menu.kernels=[1,2]",
                             "sensitivity.budget=0.9"],
                            {"menu.json", "menu.csv", "menu.png", "menu_resnet20.yaml", "sensitivity.log"}),
}


@pytest.mark.parametrize("prog", RUNS)
def test_everything_goes_to_the_run_dir(prog: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_cli,
                                        tiny: tuple[str, ...]) -> None:
    cwd, run_dir = tmp_path / "cwd", tmp_path / "X"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    args, files = RUNS[prog]
    result = run_cli(MAINS[prog], prog, *tiny, *args, f"hydra.run.dir={run_dir}")
    assert result.status == 0, result.stderr
    written = {p.name for p in run_dir.iterdir()}
    assert files | {".hydra"} <= written, written
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert not list(cwd.iterdir())  # no outputs/ beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X", "cwd"]


@pytest.mark.parametrize("prog, args, run_dir", [
    ("lessmem-coverage", ["compression=pool2"], "outputs/coverage/resnet20_pool2"),
    ("lessmem-coverage", ["coverage.out=there"], "there"),
    ("lessmem-coverage", ["coverage.out=there", "hydra.run.dir=here"], "here"),
    ("lessmem-plan", ["batch_size=64", "memory_budget=6GiB"], "outputs/plan/resnet20_b64_6GiB"),
    ("lessmem-plan", ["out_dir=there"], "there"),
    ("lessmem-sensitivity", ["model=resnet18_cifar"], "outputs/sensitivity/resnet18_cifar"),
    ("lessmem-sensitivity", ["sensitivity.out=there"], "there"),
])
def test_run_dir_defaults_and_aliases(prog: str, args: list[str], run_dir: str, run_cli) -> None:
    result = run_cli(MAINS[prog], prog, *args, "--cfg", "all", "--resolve", "-p", "hydra.run.dir")
    assert result.status == 0, result.stderr
    assert result.stdout.strip() == run_dir


def test_coverage_multirun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_cli, tiny: tuple[str, ...]) -> None:
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    result = run_cli(coverage.main, "lessmem-coverage", "-m", *tiny, "compression=pool2,pool4", "coverage.batch=2",
                     f"hydra.sweep.dir={sweep}")
    assert result.status == 0, result.stderr
    jobs = sorted(sweep.glob("*/coverage.json"))  # job dirs: <num>_<the job's overrides>
    assert [p.parent.name[:2] for p in jobs] == ["0_", "1_"] and "compression=pool4" in jobs[1].parent.name
    pool2, pool4 = (json.loads(p.read_text())["summary"]["share_of_stock"] for p in jobs)
    assert pool4 < pool2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


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
