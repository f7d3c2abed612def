"""Seeded, counter-based noise for unbiased stochastic rounding.

Each quantization draws a fresh 32-bit key from (seed, number of calls so far); element i's
noise is a hash of (key, i). No torch generator is touched, so compressing a layer never shifts
the data order or the augmentation of a run, and the same hash is computed bit for bit by the
torch reference, the C++ kernel and the Triton kernel. ``rounding_state`` / ``load_rounding_state``
carry the counter through a checkpoint, so a resumed run draws the noise it would have drawn.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
_state = {"seed": 0, "calls": 0}


def hash32(v: Tensor | int) -> Tensor | int:
    """``lowbias32`` (Wellons): a well-mixed 32-bit integer hash. ``v`` holds values in
    [0, 2^32) (int64 tensor or Python int); products wrap, and only their low 32 bits are kept."""
    v = v ^ (v >> 16)
    v = (v * 0x7FEB352D) & MASK32
    v = v ^ (v >> 15)
    v = (v * 0x846CA68B) & MASK32
    return v ^ (v >> 16)


def set_rounding_seed(seed: int) -> None:
    """Start the noise stream of ``seed`` (a run calls this with its own seed)."""
    _state["seed"], _state["calls"] = int(seed) & MASK32, 0


def rounding_state() -> dict[str, int]:
    return dict(_state)


def load_rounding_state(state: dict[str, int]) -> None:
    _state["seed"], _state["calls"] = int(state["seed"]), int(state["calls"])


def next_key() -> int:
    """The key of the next quantization call (and advance the counter)."""
    key = hash32((hash32(_state["seed"]) + _state["calls"]) & MASK32)
    _state["calls"] += 1
    return int(key)


def noise_hashes(n: int, key: int, device: torch.device | str = "cpu") -> Tensor:
    """Element i's hash, hash32((i + key) mod 2^32), for i in [0, n) (int64)."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    return hash32((i + key) & MASK32)


def uniform_noise(n: int, key: int, device: torch.device | str = "cpu") -> Tensor:
    """n float32 values in [0, 1): element i is hash32((i + key) mod 2^32) >> 8, times 2^-24."""
    return (noise_hashes(n, key, device) >> 8).to(torch.float32).mul_(2.0**-24)
