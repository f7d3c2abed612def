"""Training and evaluation loaders with one interface (``set_epoch``, ``len``, iteration over
normalized ``(images, labels)`` or ``(tokens, next tokens)``): tensors in memory, a torch
DataLoader for large images, token blocks for text."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lessmem.experiment.data.augment import random_crop_flip
from lessmem.experiment.data.blocks import RandomBlockLoader, SequentialBlockLoader
from lessmem.experiment.data.datasets import build_datasets
from lessmem.experiment.data.images import TensorImages
from lessmem.experiment.data.sharding import EpochSharding
from lessmem.experiment.data.text import TokenStream


class TensorLoader:
    """Batches from TensorImages: seeded shuffle + augmentation per epoch (``set_epoch``).

    Distributed (``world_size`` > 1): each rank yields its ``batch_size`` rows of every global
    batch (``EpochSharding``); augmentation draws for the whole global batch, so the shards equal
    one process's batch. A rank whose shard of a short last (eval) batch is empty skips it."""

    def __init__(
        self,
        data: TensorImages,
        batch_size: int,
        *,
        shuffle: bool,
        augment: bool,
        mean: Sequence[float],
        std: Sequence[float],
        seed: int = 0,
        drop_last: bool = False,
        max_steps: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.data, self.augment = data, augment
        self.sharding = EpochSharding(len(data), batch_size, shuffle=shuffle, drop_last=drop_last, seed=seed,
                                      max_steps=max_steps, rank=rank, world_size=world_size)
        self.mean = torch.tensor(list(mean)).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(list(std)).view(1, -1, 1, 1) * 255
        self.pad = max(1, data.images.shape[-1] // 8)  # 4 px at 32x32

    def set_epoch(self, epoch: int) -> None:
        self.sharding.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sharding)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        g = self.sharding.generator()
        rows = self.sharding.rows
        for batch in self.sharding.global_batches(g):
            idx = batch[rows]
            x = self.data.images[idx]
            if self.augment:  # draws for the whole global batch: the same stream on every rank
                x = random_crop_flip(x, self.pad, g, n=len(batch), rows_of=rows)
            if len(idx) == 0:
                continue
            yield (x.float() - self.mean) / self.std, self.data.labels[idx]


class DatasetLoader:
    """A torch Dataset (PIL transforms, workers) behind the TensorLoader interface: the batches
    come from ``EpochSharding``, each rank loading only its rows of every global batch."""

    def __init__(self, ds: Any, batch_size: int, *, shuffle: bool, workers: int, seed: int,
                 max_steps: int | None = None, rank: int = 0, world_size: int = 1) -> None:
        self.ds, self.workers = ds, workers
        self.sharding = EpochSharding(len(ds), batch_size, shuffle=shuffle, drop_last=shuffle, seed=seed,
                                      max_steps=max_steps, rank=rank, world_size=world_size)

    def set_epoch(self, epoch: int) -> None:
        self.sharding.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sharding)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        from torch.utils.data import DataLoader

        rows = self.sharding.rows
        batches = [mine for batch in self.sharding.global_batches(self.sharding.generator())
                   if len(mine := batch[rows].tolist())]
        yield from DataLoader(self.ds, batch_sampler=batches, num_workers=self.workers, pin_memory=True)


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
