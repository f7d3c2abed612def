"""Training and evaluation loaders with one interface (``set_epoch``, ``len``, iteration over
normalized ``(images, labels)`` or ``(tokens, next tokens)``): tensors in memory, a torch
DataLoader for large images, token blocks for text.

Every epoch's batches are drawn from a generator seeded by (seed, epoch) (``EpochSharding``):
every rank draws the same order of the whole dataset, cuts it into global batches of
``world_size * batch_size`` and keeps its own ``batch_size`` rows of each. So N ranks with batch B
see exactly the batches of one process with batch N*B, and a run resumed at epoch e, step s
(``set_epoch(e, start=s)``) sees exactly the batches of an uninterrupted one: the skipped steps'
random numbers are drawn, their samples never loaded."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor

from lessmem.experiment.data.datasets import build_datasets
from lessmem.experiment.data.images import CropFlip, TensorImages
from lessmem.experiment.data.text import TokenStream
from lessmem.experiment.runtime import epoch_generator

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11


class Order(TypedDict, total=False):
    """How an epoch's samples are ordered and shared out (EpochSharding's options)."""

    shuffle: bool
    drop_last: bool
    seed: int
    max_steps: int | None
    rank: int
    world_size: int


class EpochSharding:
    """The batches of ``n`` samples for the epoch (and first step) set by ``set_epoch``."""

    def __init__(self, n: int, batch_size: int, **order: Unpack[Order]) -> None:
        rank, world_size = order.get("rank", 0), order.get("world_size", 1)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.n, self.shuffle, self.drop_last = n, order.get("shuffle", False), order.get("drop_last", False)
        self.global_batch = batch_size * world_size
        self.rows = slice(rank * batch_size, (rank + 1) * batch_size)  # this rank's rows of a batch
        self.seed, self.max_steps = order.get("seed", 0), order.get("max_steps")
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        steps = self.n // self.global_batch if self.drop_last else math.ceil(self.n / self.global_batch)
        return steps if self.max_steps is None else min(steps, self.max_steps)

    def generator(self) -> torch.Generator:
        """This epoch's generator: the order is drawn from it first, augmentation after."""
        return epoch_generator(self.seed, self.epoch)

    def global_batches(self, g: torch.Generator) -> Iterator[Tensor]:
        """Sample indices of each global batch of the epoch, from its first step (take ``rows``
        for this rank's)."""
        order = torch.randperm(self.n, generator=g) if self.shuffle else torch.arange(self.n)
        for step in range(len(self)):
            yield order[step * self.global_batch : (step + 1) * self.global_batch]


class TensorLoader:
    """Batches from TensorImages: seeded shuffle + augmentation per epoch (``set_epoch``).

    Distributed (``world_size`` > 1): each rank yields its ``batch_size`` rows of every global
    batch (``EpochSharding``); augmentation draws for the whole global batch, so the shards equal
    one process's batch. A rank whose shard of a short last (eval) batch is empty skips it."""

    def __init__(self, data: TensorImages, batch_size: int, *, augment: bool, mean: Sequence[float],
                 std: Sequence[float], **order: Unpack[Order]) -> None:
        self.data, self.augment = data, augment
        self.sharding = EpochSharding(len(data), batch_size, **order)
        self.mean = torch.tensor(list(mean)).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(list(std)).view(1, -1, 1, 1) * 255
        self.pad = max(1, data.images.shape[-1] // 8)  # 4 px at 32x32

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sharding.set_epoch(epoch, start)

    def __len__(self) -> int:
        return len(self.sharding)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        g = self.sharding.generator()
        rows = self.sharding.rows
        for step, batch in enumerate(self.sharding.global_batches(g)):
            # draws for the whole global batch: the same stream on every rank
            crop_flip = CropFlip.draw(g, len(batch), self.pad) if self.augment else None
            idx = batch[rows]
            if step < self.sharding.start or len(idx) == 0:
                continue
            x = self.data.images[idx]
            if crop_flip is not None:
                x = crop_flip.apply(x, self.pad, rows_of=rows)
            yield (x.float() - self.mean) / self.std, self.data.labels[idx]


class DatasetLoader:
    """A torch Dataset (PIL transforms, workers) behind the TensorLoader interface: the batches
    come from ``EpochSharding``, each rank loading only its rows of every global batch."""

    def __init__(self, ds: Any, batch_size: int, *, workers: int, **order: Unpack[Order]) -> None:
        self.ds, self.workers = ds, workers
        self.sharding = EpochSharding(len(ds), batch_size, **{"drop_last": order.get("shuffle", False), **order})

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sharding.set_epoch(epoch, start)

    def __len__(self) -> int:
        return len(self.sharding)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        from torch.utils.data import DataLoader

        rows = self.sharding.rows
        batches = [mine for step, batch in enumerate(self.sharding.global_batches(self.sharding.generator()))
                   if step >= self.sharding.start and len(mine := batch[rows].tolist())]
        yield from DataLoader(self.ds, batch_sampler=batches, num_workers=self.workers, pin_memory=True)


class RandomBlockLoader:
    """Training batches as in nanoGPT: every global batch draws its block starts uniformly from
    the epoch's generator, so an epoch is reproducible from (seed, epoch) alone and a resumed run
    sees the batches of an uninterrupted one. An epoch is as many steps as the split holds
    tokens for (``max_steps`` caps it). With several ranks each keeps its rows of a global batch."""

    def __init__(self, data: TokenStream, batch_size: int, *, seed: int, max_steps: int | None = None,
                 rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.data, self.seed, self.epoch, self.start = data, seed, 0, 0
        self.global_batch = batch_size * world_size
        self.rows = slice(rank * batch_size, (rank + 1) * batch_size)
        steps = max(1, len(data.tokens) // (self.global_batch * data.seq_len))
        self.steps = steps if max_steps is None else min(steps, int(max_steps))

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        g = epoch_generator(self.seed, self.epoch)
        high = len(self.data.tokens) - self.data.seq_len  # the last start whose target fits, + 1
        for step in range(self.steps):
            starts = torch.randint(0, high, (self.global_batch,), generator=g)
            if step >= self.start:
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
        self.sharding = EpochSharding(count, batch_size, rank=rank, world_size=world_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sharding.set_epoch(epoch, start)

    def __len__(self) -> int:
        return len(self.sharding)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        for step, batch in enumerate(self.sharding.global_batches(self.sharding.generator())):
            idx = batch[self.sharding.rows]
            if step >= self.sharding.start and len(idx):
                yield self.data.blocks_at(self.starts[idx])


def build_loaders(
    cfg: Mapping[str, Any], batch_size: int, eval_batch_size: int, seed: int, max_steps: int | None = None,
    rank: int = 0, world_size: int = 1,
) -> tuple[Any, Any]:
    """(train_loader, val_loader) for the ``dataset`` config group. Batch sizes are per rank;
    with ``world_size`` > 1 each loader yields rank ``rank``'s shard of every global batch."""
    train, val = build_datasets(cfg)
    shard = {"rank": rank, "world_size": world_size}
    if isinstance(train, TokenStream):
        return (RandomBlockLoader(train, batch_size, seed=seed, max_steps=max_steps, **shard),
                SequentialBlockLoader(val, eval_batch_size, max_blocks=cfg.get("val_blocks"), **shard))
    if not isinstance(train, TensorImages):
        workers = int(cfg.get("workers", 0))
        return (DatasetLoader(train, batch_size, shuffle=True, workers=workers, seed=seed, max_steps=max_steps,
                              **shard),
                DatasetLoader(val, eval_batch_size, shuffle=False, workers=workers, seed=seed, **shard))
    if len(train) < batch_size * world_size:
        raise ValueError(f"batch_size {batch_size} x {world_size} ranks exceeds the {len(train)} training images")
    norm = {"mean": cfg["mean"], "std": cfg["std"]}
    return (
        TensorLoader(train, batch_size, shuffle=True, augment=bool(cfg.get("augment", True)),
                     seed=seed, drop_last=True, max_steps=max_steps, **norm, **shard),
        TensorLoader(val, eval_batch_size, shuffle=False, augment=False, **norm, **shard),
    )
