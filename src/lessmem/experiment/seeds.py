"""Seeds and RNG state: the per-epoch seed, process-wide seeding, and the RNG state a checkpoint
carries (plain data and tensors, so checkpoints load with ``torch.load(weights_only=True)``).

The stochastic rounding of the b-bit storages draws its noise from the core's own counter-based
stream (``lessmem.core.rounding``), not from torch's generator: a run seeds it with its seed, and
a checkpoint carries its counter, so a resumed run rounds as the uninterrupted one would have."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from lessmem.core import load_rounding_state, rounding_state, set_rounding_seed


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch`` of a run seeded ``seed``. Reseeding every epoch makes an epoch's
    randomness (shuffle, augmentation, dropout) independent of earlier epochs, so a resumed run
    matches an uninterrupted one without replaying RNG streams. The prime stride keeps the seeds
    of (seed, epoch) pairs distinct for any epoch count below it."""
    return seed * 100_003 + epoch


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """A CPU generator seeded for epoch ``epoch`` (shuffles and augmentation draw from it)."""
    return torch.Generator().manual_seed(epoch_seed(seed, epoch))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    set_rounding_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors, tuples and numbers (numpy's key array as a list of ints), and
    the rounding noise's (seed, calls so far)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "python": random.getstate(),
        "numpy": (name, key.tolist(), int(pos), int(has_gauss), float(gauss)),
        "rounding": rounding_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    # Generators take their state as a CPU tensor; a checkpoint may have been loaded to the GPU.
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    random.setstate(state["python"])
    name, key, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    if "rounding" in state:  # checkpoints written before the rounding stream lack it
        load_rounding_state(state["rounding"])
