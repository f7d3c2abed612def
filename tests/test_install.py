"""Installed like a real package: a wheel of the project, installed (not editable) into a fresh
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
from pathlib import Path

import pytest

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
