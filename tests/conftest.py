"""Shared fixtures: tiny configs, the real CIFAR-10 subset, and console commands run in-process.

Every test runs with W&B disabled and a throwaway decode cache, so nothing reaches the network or
the user's ``~/.cache/lessmem``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from lessmem.experiment import compose_config

REPO = Path(__file__).parents[1]
CIFAR = REPO.parent / "shared" / "data" / "cifar10"

# resnet20 on 64 synthetic images (2 steps of 32), 32 to validate, one epoch: a few seconds.
TINY_SYNTHETIC = (
    "model=resnet20", "compression=pool2", "dataset=synthetic", "dataset.size=64", "dataset.val_size=32",
    "batch_size=32", "eval_batch_size=32", "memory_batch=4", "epochs=1", "logger=disabled", "device=cpu",
)
# tiny_llama at width 64 on 1 MB of the stdlib, blocks of 32, 4 steps of 8: seconds per run.
TINY_LM = (
    "experiment=lm_quick", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
    "dataset.seq_len=32", "dataset.size_mb=1", "dataset.val_blocks=16", "batch_size=8", "eval_batch_size=8",
    "memory_batch=4", "max_steps_per_epoch=4",
)


@pytest.fixture(scope="session", autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    keep = {k: os.environ.get(k) for k in ("LESSMEM_CACHE", "WANDB_MODE", "WANDB_SILENT")}
    os.environ.update(LESSMEM_CACHE=str(tmp_path_factory.mktemp("decode_cache")),
                      WANDB_MODE="disabled", WANDB_SILENT="true")
    yield
    for key, value in keep.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: a second intra-op thread only spins (CPU time, not speed) on the 2-core
    machines the suite runs on. The kernels' threaded split has its own test (test_kernels)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny() -> tuple[str, ...]:
    """Overrides for a tiny CPU run on synthetic data; overrides after them win (``epochs=``,
    ``compression=none`` for a stock run ...)."""
    return TINY_SYNTHETIC


@pytest.fixture(scope="session")
def tiny_lm() -> tuple[str, ...]:
    """Overrides for a tiny causal-LM run (``experiment=lm_quick`` shrunk); later overrides win."""
    return TINY_LM


@pytest.fixture(scope="session")
def cifar_root() -> Path:
    """The real CIFAR-10 (ImageFolder JPEGs) beside the checkout; the test skips without it."""
    if not CIFAR.is_dir():
        pytest.skip(f"CIFAR-10 not found at {CIFAR}")
    return CIFAR


@pytest.fixture(scope="session")
def tiny_cifar(tiny: tuple[str, ...], cifar_root: Path) -> tuple[str, ...]:
    """``tiny`` on the real CIFAR-10: 64 training images, 32 to validate (skips without the data)."""
    synthetic = ("dataset=synthetic", "dataset.size=", "dataset.val_size=")
    return (*(o for o in tiny if not o.startswith(synthetic)),
            f"dataset.root={cifar_root}", "dataset.train_subset=64", "dataset.val_subset=32")


@pytest.fixture
def compose() -> Callable[..., DictConfig]:
    """``compose(*overrides)``: the train config as Hydra composes it."""
    return lambda *overrides: compose_config(list(overrides))


@dataclass
class CliResult:
    status: int
    stderr: list[str]  # its non-empty lines
    stdout: str

    def is_one_error(self, prog: str, expected: str) -> bool:
        """The contract for a user error: exit 2 and one line ``<prog>: error: ...`` naming it."""
        return (self.status == 2 and len(self.stderr) == 1
                and self.stderr[0].startswith(f"{prog}: error: ") and expected in self.stderr[0])


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """``run_cli(main, prog, *args)`` runs a console entry in this process as the shell would
    (``sys.argv``, exit status)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def run(main: Callable[..., object], prog: str, *args: str) -> CliResult:
        monkeypatch.setattr(sys, "argv", [prog, *args])
        capsys.readouterr()
        try:
            result = main()
            status = result if isinstance(result, int) else 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        finally:
            GlobalHydra.instance().clear()
        out, err = capsys.readouterr()
        return CliResult(status, [line for line in err.splitlines() if line.strip()], out)

    return run
