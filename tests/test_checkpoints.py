"""Checkpoints: what a run saves loads safely, and an interrupted run resumes exactly.

Checkpoints load with ``weights_only=True``: a file whose pickle would run code is refused
(resume, ``load_checkpoint``, ``sensitivity.checkpoint=``) with one error line, and what a run
saves (RNG state included) loads that way.

SIGINT / SIGTERM during training: the step finishes, a checkpoint carries the data position and
the epoch's sums, and ``resume=true`` ends exactly where the uninterrupted run ends (in process:
the test sends the signal to itself from inside a training step)."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

import lessmem.experiment.train as train_mod
from lessmem.cli import sensitivity
from lessmem.cli.train import resume_command
from lessmem.core.rounding import next_key, set_rounding_seed
from lessmem.experiment import Interrupted, compose_config, load_checkpoint, run
from lessmem.experiment.checkpoint import RESUME_KEYS
from lessmem.experiment.runtime import rng_state, set_rng_state
from lessmem.experiment.train import TIME_KEYS


class RunsCode:
    """Unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def code_running_checkpoint(folder: Path) -> tuple[Path, Path]:
    """(checkpoint.pt with every resume key, one of them a payload; the marker it would create)."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "pwned"
    ckpt = {key: 0 for key in RESUME_KEYS} | {"model": RunsCode(marker)}
    torch.save(ckpt, folder / "checkpoint.pt")
    return folder / "checkpoint.pt", marker


def test_resume_cli_refuses_code_running_checkpoint(tmp_path: Path, tiny, run_cli) -> None:
    from lessmem.cli.train import train_main

    run_dir = tmp_path / "run"
    _, marker = code_running_checkpoint(run_dir)
    result = run_cli(train_main, "lessmem-train", *tiny, f"hydra.run.dir={run_dir}", "resume=true")
    assert result.is_one_error("lessmem-train", "could run code"), result
    assert not marker.exists()


def test_load_checkpoint_refuses_code_running_checkpoint(tmp_path: Path) -> None:
    path, marker = code_running_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="objects other than tensors and plain data.*GLOBAL .*system"):
        load_checkpoint(torch.nn.Linear(2, 2), path)
    assert not marker.exists()


def test_sensitivity_refuses_code_running_checkpoint(tmp_path: Path, run_cli, tiny) -> None:
    path, marker = code_running_checkpoint(tmp_path)
    result = run_cli(sensitivity.main, "lessmem-sensitivity", *tiny, f"sensitivity.checkpoint={path}",
                     f"sensitivity.out={tmp_path / 'o'}")
    assert result.is_one_error("lessmem-sensitivity", "checkpoint"), result.stderr
    assert "could run code" in result.stderr[0]
    assert not marker.exists()


def test_load_checkpoint_takes_state_dict_or_training_checkpoint(tmp_path: Path) -> None:
    source = torch.nn.Linear(2, 2)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    torch.save({"model": source.state_dict(), "epoch": 3}, tmp_path / "checkpoint.pt")
    for name in ("weights.pt", "checkpoint.pt"):
        target = torch.nn.Linear(2, 2)
        load_checkpoint(target, tmp_path / name)
        assert torch.equal(target.weight, source.weight), name


def test_rng_state_survives_weights_only_round_trip(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # a cached Gaussian is part of numpy's state
    set_rounding_seed(4)
    next_key()  # the rounding stream's counter is part of it too
    torch.save({"rng": rng_state()}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.standard_normal(3).tolist(), next_key(), torch.rand(3))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    again = (random.random(), np.random.standard_normal(3).tolist(), next_key(), torch.rand(3))
    assert again[:3] == expected[:3] and torch.equal(again[3], expected[3])


# 3 epochs of 4 steps (8 images each), int4 codes with stochastic rounding: every step draws noise.
STEPS = ("dataset.size=32", "batch_size=8", "eval_batch_size=16", "epochs=3", "compression.norm_storage=int4",
         'compression.map="*:2/int4"')


def comparable(metrics: dict) -> dict:
    out = {k: v for k, v in metrics.items() if k not in TIME_KEYS}
    out["history"] = [{k: v for k, v in h.items() if k not in TIME_KEYS} for h in metrics["history"]]
    return out


def _signal_at_step(monkeypatch: pytest.MonkeyPatch, signum: int, nth: int) -> None:
    """The ``nth`` training step (counting from 1) sends ``signum`` to this process mid-step."""
    calls = {"n": 0}

    def signal_mid_step(name: str) -> None:
        calls["n"] += 1
        if calls["n"] == nth:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(train_mod, "fault_point", signal_mid_step)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, tiny: tuple[str, ...]) -> dict:
    out = tmp_path_factory.mktemp("straight")
    return run(compose_config([*tiny, *STEPS, f"out_dir={out}"])) | {"out": out}


# SIGTERM (what a scheduler sends) by default; Ctrl-C's SIGINT takes the same path, in the slow run
@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGTERM])
def test_signal_at_a_random_step_then_resume_matches_the_straight_run(
        signum: int, straight: dict, compose, tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nth = random.Random(signum).randrange(1, 12)  # any of the first 11 of 12 steps
    before = signal.getsignal(signum)
    with monkeypatch.context() as patch:
        _signal_at_step(patch, signum, nth)
        with pytest.raises(Interrupted) as stopped:
            run(compose(*tiny, *STEPS, f"out_dir={tmp_path}"))
    assert stopped.value.exit_code == 128 + signum and str(tmp_path) in str(stopped.value)
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert (ckpt["epoch"], ckpt["step"]) == ((nth - 1) // 4, (nth - 1) % 4 + 1)  # after the signalled step
    assert not (tmp_path / "metrics.json").exists()
    assert signal.getsignal(signum) == before  # the run's handlers are gone

    resumed = run(compose(*tiny, *STEPS, f"out_dir={tmp_path}", "resume=true"))
    assert comparable(resumed) == comparable({k: v for k, v in straight.items() if k != "out"})
    final, ref = (torch.load(d / "checkpoint.pt", weights_only=True)["model"] for d in (tmp_path, straight["out"]))
    assert all(torch.equal(final[k], ref[k]) for k in ref)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_checkpoint_every_steps_saves_within_the_epoch(compose, tiny, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    saved = []
    original = train_mod.Checkpoints.save

    def spy(self, state, at) -> None:
        saved.append((at.epoch, at.step))
        original(self, state, at)

    monkeypatch.setattr(train_mod.Checkpoints, "save", spy)
    run(compose(*tiny, *STEPS, "epochs=1", "checkpoint_every_steps=3", f"out_dir={tmp_path}"))
    assert saved == [(0, 3), (1, 0)]  # step 3 of 4, then the epoch's end


def test_resume_without_a_checkpoint_names_what_happened(compose, tiny, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run was started in"):
        run(compose(*tiny, f"out_dir={tmp_path / 'empty'}", "resume=true"))
    (tmp_path / "started").mkdir()
    (tmp_path / "started" / "config.yaml").write_text("{}")
    with pytest.raises(FileNotFoundError, match="stopped before its first checkpoint"):
        run(compose(*tiny, f"out_dir={tmp_path / 'started'}", "resume=true"))


def test_resume_command_keeps_the_overrides_and_names_the_directory() -> None:
    line = resume_command(["model=resnet20", "resume=false", 'compression.map="*:2"'], "/runs/a b", own_dir=False)
    assert line == "lessmem-train model=resnet20 'compression.map=\"*:2\"' resume=true 'hydra.run.dir=/runs/a b'"
    assert resume_command(["out_dir=/x"], "/x", own_dir=True) == "lessmem-train resume=true out_dir=/x"


def test_epoch_lines_reach_the_log(compose, tiny, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        m = run(compose(*tiny, "epochs=2", "log_every_steps=1", f"out_dir={tmp_path}"))
    lines = [r.getMessage() for r in caplog.records]
    epochs = [line for line in lines if line.startswith("epoch ") and "val_top1" in line]
    assert len(epochs) == 2 and f"saved ratio {m['ratio']:.3f}" in epochs[-1]
    steps = [line for line in lines if line.startswith("epoch 1/2: 1/2 step (50%)")]  # no terminal: step lines
    assert len(steps) == 1 and ", loss " in steps[0] and ", lr " in steps[0]
    assert any(line.startswith("epoch 2/2: 2/2 step in ") for line in lines)
    assert "\r" not in caplog.text
    assert json.loads((tmp_path / "metrics.json").read_text())["epochs"] == 2
