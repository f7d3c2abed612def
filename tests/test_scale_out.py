"""Scale-out: Hydra joblib / submitit_local launchers, torchrun DDP equivalence (CPU, gloo),
Optuna workers sharing one study. All on tiny synthetic data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).parents[1]
# BN-free (LayerNorm) ViT, one block of width 32, with every conv / linear input pooled 2x2:
# torch's SyncBatchNorm is CUDA-only, and DDP without it keeps BatchNorm statistics per rank.
TINY_VIT = ["model=vit_tiny_cifar", "+model.num_layers=1", "+model.hidden_dim=32", "+model.mlp_dim=64",
            "+model.num_heads=2", "+model.patch_size=8", "compression=pool2", "dataset=synthetic",
            "dataset.size=32", "dataset.val_size=16", "dataset.augment=true", "epochs=1",
            "max_steps_per_epoch=2", "memory_batch=2", "eval_batch_size=8", "logger=disabled", "device=cpu"]


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HYDRA_FULL_ERROR": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_joblib_multirun_two_parallel_jobs(tmp_path: Path, tiny: tuple[str, ...]) -> None:
    sweep = tmp_path / "sweep"
    _run([sys.executable, "-m", "lessmem.cli.train", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
          *tiny, "compression=none,pool2", "max_steps_per_epoch=1", f"hydra.sweep.dir={sweep}"], tmp_path)
    results = sorted(sweep.glob("*/metrics.json"))
    assert len(results) == 2
    assert {json.loads(p.read_text())["compression"] for p in results} == {"none", "pool2"}


@pytest.mark.slow
def test_submitit_local_job(tmp_path: Path, tiny: tuple[str, ...]) -> None:
    sweep = tmp_path / "sweep"
    _run([sys.executable, "-m", "lessmem.cli.train", "-m", "hydra/launcher=submitit_local",
          "hydra.launcher.timeout_min=5", *tiny, "max_steps_per_epoch=1", f"hydra.sweep.dir={sweep}"], tmp_path)
    results = list(sweep.glob("*/metrics.json"))
    assert len(results) == 1 and json.loads(results[0].read_text())["compression"] == "pool2"
    assert list((sweep / ".submitit").rglob("*_result.pkl"))  # ran as a submitit job


def test_launcher_and_grid_configs_compose(run_cli) -> None:
    """The SLURM presets and the grid sweep file resolve (nothing is submitted)."""
    from hydra import compose, initialize_config_dir

    from lessmem.experiment.paths import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm_gpu", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gpu"
    assert launcher.gpus_per_node == 1 and launcher.timeout_min > 0
    assert "distributed" in cfg and cfg.sync_bn is False
    from lessmem.cli.train import train_main

    result = run_cli(train_main, "lessmem-train", "-cd", str(REPO / "sweeps"), "-cn", "grid_cifar", "--cfg", "hydra",
                     "-p", "hydra.sweeper.params")
    assert result.status == 0, result.stderr
    for key in ("model:", "compression:", "seed:"):
        assert key in result.stdout, result.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_two_ranks_equal_one_process_double_batch(tmp_path: Path) -> None:
    """2 gloo ranks with batch 4 each == 1 process with batch 8 (compressed layers on, augmentation
    on, SGD with momentum, 2 steps); only rank 0 writes files."""
    _run([sys.executable, "-m", "lessmem.cli.train", *TINY_VIT, "batch_size=8", f"out_dir={tmp_path / 'one'}",
          f"hydra.run.dir={tmp_path / 'h1'}"], tmp_path)
    _run(["torchrun", "--standalone", "--nproc_per_node=2", "-m", "lessmem.cli.train", *TINY_VIT, "batch_size=4",
          f"out_dir={tmp_path / 'two'}", f"hydra.run.dir={tmp_path / 'h2'}"], tmp_path)
    one = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)
    two = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    assert one["model"].keys() == two["model"].keys()  # no "module." prefix
    for k, v in one["model"].items():
        torch.testing.assert_close(two["model"][k], v, rtol=1e-4, atol=1e-5, msg=k)
    assert two["memory"]["ratio"] < 1  # compressed layers were on
    h1, h2 = one["history"][0], two["history"][0]
    for key in ("train_loss", "train_top1", "val_loss", "val_top1"):
        assert h2[key] == pytest.approx(h1[key], rel=1e-5, abs=1e-6), key
    m = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert m["epochs"] == 1 and len((tmp_path / "two" / "metrics.jsonl").read_text().splitlines()) == 1


def test_tensor_loader_shards_equal_global_batch() -> None:
    from lessmem.experiment.data import TensorImages, TensorLoader

    g = torch.Generator().manual_seed(0)
    data = TensorImages(torch.randint(0, 255, (20, 3, 8, 8), generator=g, dtype=torch.uint8),
                        torch.arange(20), ["x"])
    kw = {"shuffle": True, "augment": True, "mean": [0.5] * 3, "std": [0.25] * 3, "seed": 3, "drop_last": True}
    full = list(TensorLoader(data, 6, **kw))
    shards = [list(TensorLoader(data, 3, rank=r, world_size=2, **kw)) for r in range(2)]
    assert len(full) == len(shards[0]) == len(shards[1]) == 3
    for step, (x, y) in enumerate(full):
        torch.testing.assert_close(torch.cat([shards[0][step][0], shards[1][step][0]]), x)
        assert torch.equal(torch.cat([shards[0][step][1], shards[1][step][1]]), y)
    val = [list(TensorLoader(data, 8, shuffle=False, augment=False, mean=[0.5] * 3, std=[0.25] * 3,
                             rank=r, world_size=2)) for r in range(2)]
    assert sorted(torch.cat([y for part in val for _, y in part]).tolist()) == list(range(20))


# --------------------------------------------------------------------------- Optuna workers

def _search_args(out: Path, storage: str, n_trials: int, tiny: tuple[str, ...]) -> list[str]:
    base = [*tiny, "compression=none"]
    args = {"out_dir": str(out), "storage": storage, "n_trials": n_trials, "budget": 0.6, "poll_s": 0.5,
            "sensitivity.batches": 1, "sensitivity.batch_size": 8, "base_overrides": base}
    return ["menu=kernels", *(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in args.items())]


@pytest.mark.slow
def test_two_search_workers_share_fixed_trial_count(tmp_path: Path, tiny: tuple[str, ...]) -> None:
    import optuna

    from lessmem.search import make_storage

    out, n = tmp_path / "s", 4
    args = _search_args(out, str(out / "study.journal"), n, tiny)
    cmd = [sys.executable, "-m", "lessmem.cli.search", "-cd", str(REPO / "sweeps"), "-cn", "train_resnet20",
           "worker=true", *args]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stdout[-2000:] + stderr[-4000:]
    study = optuna.load_study(study_name="train_resnet20", storage=make_storage(out / "study.journal"))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == n  # exactly n together, none counted twice
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    seeds = [t.user_attrs["seed"] for t in complete if "seed" in t.user_attrs]
    assert seeds == ["knapsack"]  # enqueued once, run once
    assert all("worker" in t.user_attrs for t in complete)
    assert json.loads((out / "summary.json").read_text())["complete_trials"] == n


def test_worker_stale_handling_spares_live_trials(tmp_path: Path) -> None:
    """Journal (no heartbeat): a RUNNING trial of a live worker stays; one whose process is gone
    on this host is failed and its params queued again. RDB URLs get heartbeats + retries."""
    import socket

    import optuna
    from optuna.storages import RDBStorage

    from lessmem.search import Heartbeat, fail_dead_trials, make_storage

    study = optuna.create_study(study_name="w", storage=make_storage(tmp_path / "j.journal"))
    # The process boundary is the point: a pid the OS reports gone needs a process that has exited.
    with subprocess.Popen([sys.executable, "-S", "-c", ""]) as exited:
        pass
    dead = exited.pid
    live, gone = study.ask({"x": optuna.distributions.IntDistribution(0, 9)}), study.ask({"x": optuna.distributions.IntDistribution(0, 9)})
    live.set_user_attr("worker", {"host": socket.gethostname(), "pid": os.getpid()})
    gone.set_user_attr("worker", {"host": socket.gethostname(), "pid": dead})
    fresh = study.ask()  # no worker recorded yet, just started: within the grace period
    assert fail_dead_trials(study, grace_s=60) == [gone.number]
    states = {t.number: t.state.name for t in study.trials}
    assert states[live.number] == "RUNNING" and states[fresh.number] == "RUNNING"
    assert states[gone.number] == "FAIL" and list(states.values()).count("WAITING") == 1

    storage = make_storage(f"sqlite:///{tmp_path / 'rdb.db'}", Heartbeat())
    assert isinstance(storage, RDBStorage) and storage.heartbeat_interval == 60
    assert storage.get_heartbeat_stale_trial_callback() is not None


def test_sync_bn_on_cpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's SyncBatchNorm is CUDA-only: sync_bn=true with several CPU ranks fails up front."""
    from hydra import compose, initialize_config_dir

    from lessmem.experiment.paths import conf_dir
    from lessmem.experiment.runtime import validate

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=["sync_bn=true", "device=cpu"])
    validate(cfg, torch.device("cpu"))  # one process: nothing to synchronize
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="sync_bn=true needs CUDA"):
        validate(cfg, torch.device("cpu"))
