"""Faults: crashes, bad inputs and diverged training.

Crashes and bad inputs through the console entries (subprocesses, CPU, tiny synthetic data).

Kills are real SIGKILLs: ``LESSMEM_FAULT=<point>:<n>`` (``lessmem.experiment.runtime.fault_point``) makes the process
kill itself at a chosen step or inside a checkpoint write, so the crash lands at the same place
every time. After each kill a ``resume=true`` run must end exactly like an uninterrupted one.

A non-finite loss or gradient ends a run at that step, before the optimizer applies it, and the
run's metrics, log and reports say where (classification and language model alike)."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import lessmem.experiment.train as train_mod
from lessmem.experiment.train import TIME_KEYS, run
from lessmem.reporting.rows import row_from
from lessmem.reporting.tables import markdown_table

KILLED = -signal.SIGKILL


def _env(fault: str | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
    for key in ("HYDRA_FULL_ERROR", "LESSMEM_FAULT"):
        env.pop(key, None)
    if fault:
        env["LESSMEM_FAULT"] = fault
    return env


def _train_cmd() -> list[str]:
    exe = shutil.which("lessmem-train")  # the console entry itself when installed
    return [exe] if exe else [sys.executable, "-m", "lessmem.cli.train"]


@pytest.fixture(scope="module")
def train(tiny: tuple[str, ...]) -> Callable[..., subprocess.CompletedProcess]:
    """``train(out, *args, fault=)``: lessmem-train as its own process (a SIGKILL must end a real one),
    ``tiny`` for 3 epochs of 2 steps: a few seconds per run on one core."""

    def run(out: Path, *args: str, fault: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([*_train_cmd(), *tiny, "epochs=3", f"hydra.run.dir={out}", *args], cwd=out.parent,
                              env=_env(fault), capture_output=True, text=True, timeout=300)

    return run


def _comparable(metrics: dict) -> dict:
    out = {k: v for k, v in metrics.items() if k not in TIME_KEYS}
    out["history"] = [{k: v for k, v in h.items() if k not in TIME_KEYS} for h in metrics["history"]]
    return out


def _epochs(out: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _ckpt_epoch(out: Path) -> int:
    return int(torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)["epoch"])


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, train: Callable[..., subprocess.CompletedProcess]) -> dict:
    out = tmp_path_factory.mktemp("straight") / "run"
    proc = train(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _epochs(out) == [1, 2, 3]
    return json.loads((out / "metrics.json").read_text())


def _resume_matches(train: Callable[..., subprocess.CompletedProcess], out: Path, straight: dict) -> None:
    proc = train(out, "resume=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _epochs(out) == [1, 2, 3]  # no epoch lost, none twice
    resumed = json.loads((out / "metrics.json").read_text())
    assert [h["epoch"] for h in resumed["history"]] == [1, 2, 3]
    assert _comparable(resumed) == _comparable(straight)


@pytest.mark.slow
def test_kill_during_epoch_then_resume(train: Callable[..., subprocess.CompletedProcess], straight: dict,
                                       tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = train(out, fault="train_step:4")  # the last step of epoch 2
    assert proc.returncode == KILLED, proc.stderr[-3000:]
    assert not (out / "metrics.json").exists()
    assert _ckpt_epoch(out) == 1 and _epochs(out) == [1]
    _resume_matches(train, out, straight)


@pytest.mark.slow
def test_kill_inside_checkpoint_write_then_resume(train: Callable[..., subprocess.CompletedProcess], straight: dict,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = train(out, fault="replace_checkpoint.pt:2")  # epoch 2's checkpoint written, not renamed
    assert proc.returncode == KILLED, proc.stderr[-3000:]
    assert len(list(out.glob(".checkpoint.pt.*.tmp"))) == 1  # the half-done write
    assert _ckpt_epoch(out) == 1  # the previous checkpoint is intact
    assert _epochs(out) == [1, 2]  # epoch 2 was logged before its checkpoint: resume drops it
    _resume_matches(train, out, straight)


# --------------------------------------------------------------------------- Optuna worker


@pytest.mark.slow
def test_search_worker_killed_mid_trial_then_rerun(tmp_path: Path, tiny: tuple[str, ...]) -> None:
    import optuna

    from lessmem.search import make_storage

    base = [*tiny, "compression=none"]
    opts = {"study_name": "k", "out_dir": str(tmp_path / "s"), "n_trials": 2, "menu": "kernels",
            "budget": 0.6, "poll_s": 0.5, "sensitivity.batches": 1, "sensitivity.batch_size": 8,
            "base_overrides": base}
    args = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in opts.items()]
    cmd = [sys.executable, "-m", "lessmem.cli.search", "-cd", str(Path(__file__).parents[1] / "sweeps"),
           "-cn", "train_resnet20", "worker=true", *args]
    journal = tmp_path / "s" / "study.journal"

    killed = subprocess.run(cmd, cwd=tmp_path, env=_env("train_step:1"), capture_output=True,
                            text=True, timeout=300)
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    study = optuna.load_study(study_name="k", storage=make_storage(journal))  # the journal loads after the kill
    running = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    assert len(running) == 1 and not any(t.state.is_finished() for t in study.trials)

    rerun = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    study = optuna.load_study(study_name="k", storage=make_storage(journal))
    states = [t.state for t in study.trials]
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 2  # exactly n_trials
    assert states.count(optuna.trial.TrialState.FAIL) == 1  # the killed one
    assert optuna.trial.TrialState.RUNNING not in states
    failed = next(t for t in study.trials if t.state == optuna.trial.TrialState.FAIL)
    assert failed.number == running[0].number
    # Its queued map went back to the queue (run again, or waiting behind the other seeds).
    again = [t for t in study.trials if t.number != failed.number
             and t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.WAITING)]
    assert failed.user_attrs.get("seed") in [t.user_attrs.get("seed") for t in again]
    assert json.loads((tmp_path / "s" / "summary.json").read_text())["complete_trials"] == 2


# --------------------------------------------------------------------------- bad inputs


BAD_INPUTS = {  # case: (overrides, what the error line must say)
    "unknown model config": (["model=nonexistent"], "Could not find 'model/nonexistent'"),
    "unknown model name": (["model.name=nope"], "unknown model 'nope'; available:"),
    "unknown compression": (["compression=nope"], "Could not find 'compression/nope'"),
    "missing map file": (["compression.map_file={tmp}/none.yaml"], "does not exist"),
    "malformed map file": (["compression.map_file={tmp}/bad.yaml"], "is not valid YAML"),
    "kernel 0 in map file": (["compression.map_file={tmp}/zero.yaml"], "kernel size 0 must be >= 1"),
    "kernel 0": (["+compression.map.conv1=0"], "kernel size 0 must be >= 1"),
    "kernel -1": (["+compression.map.conv1=-1"], "kernel size -1 must be >= 1"),
    "kernel 2.5": (["+compression.map.conv1=2.5"], "kernel size 2.5 is not an integer"),
    "kernel x": (["+compression.map.conv1=x"], "'x' is neither a kernel size (an integer) nor a storage"),
    "corrupt checkpoint": (["hydra.run.dir={tmp}/corrupt", "resume=true"], "is unreadable"),
}


@pytest.fixture
def bad_files(tmp_path: Path) -> Path:
    (tmp_path / "bad.yaml").write_text("map:\n  conv1: [2\n  '*': 2\n")
    (tmp_path / "zero.yaml").write_text("map:\n  conv1: 0\n")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "checkpoint.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    return tmp_path


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_give_one_error_line(case: str, bad_files: Path, tiny, run_cli) -> None:
    from lessmem.cli.train import train_main

    overrides, expected = BAD_INPUTS[case]
    args = [a.format(tmp=bad_files) for a in overrides]
    if not any(a.startswith("hydra.run.dir=") for a in args):
        args.append(f"hydra.run.dir={bad_files / 'o'}")
    result = run_cli(train_main, "lessmem-train", *tiny, *args)
    assert result.is_one_error("lessmem-train", expected), result


@pytest.mark.slow
def test_missing_data_gives_one_error_line_from_the_console_entry(tmp_path: Path) -> None:
    """The default job (CIFAR-10) without its data, through the installed command: one line that
    says what to do."""
    env = {**_env(), "LESSMEM_DATA": str(tmp_path / "nodata")}
    proc = subprocess.run([*_train_cmd(), f"hydra.run.dir={tmp_path / 'o'}", "logger=disabled"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-1500:]
    assert lines[0].startswith("lessmem-train: error: ") and "dataset.download=true" in lines[0]


@pytest.mark.parametrize("prog, args", [("lessmem-sensitivity", ["model=nope"]),
                                        ("lessmem-coverage", ["compression=nope"])])
def test_other_entry_points_give_one_line_errors(prog: str, args: list[str], run_cli) -> None:
    from lessmem.cli import coverage, sensitivity

    main = {"lessmem-sensitivity": sensitivity.main, "lessmem-coverage": coverage.main}[prog]
    result = run_cli(main, prog, *args)
    assert result.is_one_error(prog, "nope"), result


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
