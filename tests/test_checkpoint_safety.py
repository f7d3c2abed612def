"""Checkpoints load with ``weights_only=True``: a file whose pickle would run code is refused
(resume, ``load_checkpoint``, ``sensitivity.checkpoint=``) with one error line, and what a run
saves (RNG state included) loads that way."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lessmem.cli import sensitivity
from lessmem.core.rounding import next_key, set_rounding_seed
from lessmem.experiment import load_checkpoint
from lessmem.experiment.checkpoint import RESUME_KEYS
from lessmem.experiment.runtime import rng_state, set_rng_state


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
