"""The analysis commands in-process.

Where lessmem-coverage, -plan and -sensitivity write: everything (their files, Hydra's ``.hydra/``
and the job's log) into Hydra's run dir, ``hydra.run.dir``; its default is the command's former
``outputs/<command>/...`` location, ``coverage.out`` / ``out_dir`` / ``sensitivity.out`` name the same
directory, and ``-m`` gives each job its own directory under ``hydra.sweep.dir``, as for lessmem-train.

Their ``<command>.*`` Hydra settings (and the ``menu`` group) reach the run, and a misspelled one ends with
one ``<prog>: error:`` line and exit status 2.

Last, installed like a real package (slow): installed like a real package: a wheel of the project, installed (not editable) into a fresh
venv, finds its configs from any directory. Offline: no build isolation, no dependencies fetched:
the venv sees the site-packages of the interpreter running the tests (torch, Hydra, ...), whether
that is a global install or the user's own venv, through a path file (not --system-site-packages,
which sees the base interpreter instead of the user's venv)."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
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
                     "sensitivity.batch_size=4", "menu=kernels", "menu.kernels=[1, 2]", "sensitivity.budget=0.8",
                     f"sensitivity.checkpoint={weights}",
                     f"sensitivity.out={out}", "sensitivity.time_steps=2")
    assert result.status == 0, result.stderr
    meta = MenuResult.load(out).meta
    assert meta["kernels"] == [1, 2] and (meta["batches"], meta["batch_size"], meta["weights"]) == (1, 4, str(weights))
    # the written map's step is timed against stock's: its header says the measured ratio
    measured = meta["chosen"]["measured_step_ratio"]
    assert measured > 0 and f"measured step {measured:.2f}x stock's" in (out / "menu_resnet20.yaml").read_text()
    bad = run_cli(sensitivity.main, "lessmem-sensitivity", *tiny, "sensitivity.time_steps=-1")
    assert bad.is_one_error("lessmem-sensitivity", "sensitivity.time_steps=-1: steps to time the map with"), bad


# ---- installed from a wheel ----

REPO = Path(__file__).parents[1]
SKIP = shutil.ignore_patterns(".git", "outputs", "multirun", "wandb", "build", "*.egg-info", "__pycache__",
                              ".pytest_cache", ".ruff_cache", "docs", "analysis", "benchmarks", "tests",
                              ".cache", ".whl", ".gl", ".venv*", "venv")  # a user's venv in the checkout


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_wheel_install_finds_configs_from_anywhere(tmp_path: Path, tiny: tuple[str, ...]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LESSMEM_CONF", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PIP_DISABLE_PIP_VERSION_CHECK="1")
    src = tmp_path / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=SKIP)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(tmp_path / "wheels"), str(src)], tmp_path, env)
    wheel = next((tmp_path / "wheels").glob("lessmem-*.whl"))
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    venv_site = _run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     tmp_path, env).stdout.strip()
    # Plain path lines: the parent's packages come after the venv's own, and the parent's .pth files
    # (such as an editable install of this repo) are not processed.
    (Path(venv_site) / "parent_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
         tmp_path, env)

    elsewhere = tmp_path / "elsewhere"  # no conf/ here or above
    elsewhere.mkdir()
    where = _run([str(bin_dir / "python"), "-c", "import json, lessmem, lessmem.experiment.paths as p; "
                  "import hydra_plugins.lessmem_optuna_sweeper as sweeper; "
                  "print(json.dumps([lessmem.__file__, str(p.conf_dir()), sweeper.__file__]))"], elsewhere, env)
    module, conf, sweeper = json.loads(where.stdout)
    assert all(Path(f).is_relative_to(venv) for f in (module, conf, sweeper))
    assert (Path(conf) / "train.yaml").is_file() and (Path(conf) / "compression" / "pool2.yaml").is_file()

    job = _run([str(bin_dir / "lessmem-train"), "--cfg", "job", "model=resnet18", "compression=pool2"], elsewhere, env)
    assert "name: resnet18" in job.stdout and "name: pool2" in job.stdout
    plugin = _run([str(bin_dir / "lessmem-train"), "hydra/sweeper=lessmem_optuna", "--cfg", "hydra", "-p",
                   "hydra.sweeper._target_"], elsewhere, env)  # Hydra finds the plugin in the wheel
    assert "LessmemOptunaSweeper" in plugin.stdout
    info = _run([str(bin_dir / "lessmem-info"), "compression"], elsewhere, env)
    assert "pool4" in info.stdout
    _run([str(bin_dir / "lessmem-train"), *tiny, "max_steps_per_epoch=1", f"hydra.run.dir={elsewhere / 'run'}"],
         elsewhere, env)
    assert json.loads((elsewhere / "run" / "metrics.json").read_text())["epochs"] == 1
