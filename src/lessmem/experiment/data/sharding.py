"""Per-epoch seeded batches, sharded over ranks: every rank draws the same seeded order of the
whole dataset, cuts it into global batches of ``world_size * batch_size`` and keeps its own
``batch_size`` rows of each. So N ranks with batch B see exactly the batches of one process with
batch N*B, and a run resumed at epoch e sees exactly the batches of an uninterrupted one."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from lessmem.experiment.seeds import epoch_generator


class EpochSharding:
    """The batches of ``n`` samples for the epoch set by ``set_epoch``."""

    def __init__(self, n: int, batch_size: int, *, shuffle: bool, drop_last: bool, seed: int = 0,
                 max_steps: int | None = None, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.n, self.shuffle, self.drop_last = n, shuffle, drop_last
        self.global_batch = batch_size * world_size
        self.rows = slice(rank * batch_size, (rank + 1) * batch_size)  # this rank's rows of a batch
        self.seed, self.epoch, self.max_steps = seed, 0, max_steps

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        steps = self.n // self.global_batch if self.drop_last else math.ceil(self.n / self.global_batch)
        return steps if self.max_steps is None else min(steps, self.max_steps)

    def generator(self) -> torch.Generator:
        """This epoch's generator: the order is drawn from it first, augmentation after."""
        return epoch_generator(self.seed, self.epoch)

    def global_batches(self, g: torch.Generator) -> Iterator[Tensor]:
        """Sample indices of each global batch of the epoch (take ``rows`` for this rank's)."""
        order = torch.randperm(self.n, generator=g) if self.shuffle else torch.arange(self.n)
        for step in range(len(self)):
            yield order[step * self.global_batch : (step + 1) * self.global_batch]
