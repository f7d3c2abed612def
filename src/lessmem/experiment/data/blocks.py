"""Batches of fixed-length token blocks behind the loaders' interface (``set_epoch``, ``len``,
iteration over ``(inputs, targets)``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from lessmem.experiment.data.sharding import EpochSharding
from lessmem.experiment.data.text import TokenStream
from lessmem.experiment.seeds import epoch_generator


class RandomBlockLoader:
    """Training batches as in nanoGPT: every global batch draws its block starts uniformly from
    the epoch's generator, so an epoch is reproducible from (seed, epoch) alone and a resumed run
    sees the batches of an uninterrupted one. An epoch is as many steps as the split holds
    tokens for (``max_steps`` caps it). With several ranks each keeps its rows of a global batch."""

    def __init__(self, data: TokenStream, batch_size: int, *, seed: int, max_steps: int | None = None,
                 rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.data, self.seed, self.epoch = data, seed, 0
        self.global_batch = batch_size * world_size
        self.rows = slice(rank * batch_size, (rank + 1) * batch_size)
        steps = max(1, len(data.tokens) // (self.global_batch * data.seq_len))
        self.steps = steps if max_steps is None else min(steps, int(max_steps))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        g = epoch_generator(self.seed, self.epoch)
        high = len(self.data.tokens) - self.data.seq_len  # the last start whose target fits, + 1
        for _ in range(self.steps):
            starts = torch.randint(0, high, (self.global_batch,), generator=g)
            yield self.data.blocks_at(starts[self.rows])


class SequentialBlockLoader:
    """Evaluation batches: non-overlapping blocks in order, ``max_blocks`` of them spread evenly
    over the split when it holds more (None: all); each rank evaluates its shard."""

    def __init__(self, data: TokenStream, batch_size: int, *, max_blocks: int | None = None,
                 rank: int = 0, world_size: int = 1) -> None:
        if max_blocks is not None and int(max_blocks) < 1:
            raise ValueError(f"dataset.val_blocks must be >= 1 or null (all blocks), got {max_blocks}")
        available = len(data)
        count = available if max_blocks is None else min(available, int(max_blocks))
        self.data = data
        self.starts = torch.arange(count) * available // count * data.seq_len
        self.sharding = EpochSharding(count, batch_size, shuffle=False, drop_last=False, rank=rank,
                                      world_size=world_size)

    def set_epoch(self, epoch: int) -> None:
        self.sharding.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sharding)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for batch in self.sharding.global_batches(self.sharding.generator()):
            idx = batch[self.sharding.rows]
            if len(idx):
                yield self.data.blocks_at(self.starts[idx])
