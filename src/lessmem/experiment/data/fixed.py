"""Fixed probe batches (sensitivity, search): the first batches of a seeded shuffle of one split,
un-augmented. Only the files those batches hold are decoded."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lessmem.experiment.data.cache import decode_samples
from lessmem.experiment.data.datasets import dataset_splits
from lessmem.experiment.data.images import TensorImages
from lessmem.experiment.data.loaders import EpochSharding, RandomBlockLoader, TensorLoader
from lessmem.experiment.data.scan import ImageFolderSplit
from lessmem.experiment.data.text import TokenStream


def fixed_batches(dataset: Mapping[str, Any], n: int, batch_size: int, split: str = "train",
                  seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """The first ``n`` seeded-shuffled, un-augmented batches of the ``dataset`` config group (as
    ``build_loaders`` reads it): for in-memory data, exactly the first batches a training loader of
    ``seed`` yields at epoch 0 without augmentation; for text, the first random blocks a training
    loader of ``seed`` draws."""
    from omegaconf import DictConfig, OmegaConf

    ds_cfg = OmegaConf.to_container(dataset, resolve=True) if isinstance(dataset, DictConfig) else dict(dataset)
    train, val = dataset_splits(ds_cfg)
    data = train if split == "train" else val
    available = len(data) // batch_size
    if available < n:
        raise ValueError(f"dataset has only {available} batches of {batch_size} ({split} split), asked for {n}")
    if isinstance(data, TokenStream):  # random blocks, as batches of a training loader of seed
        return list(RandomBlockLoader(data, batch_size, seed=seed, max_steps=n))
    if not isinstance(data, (TensorImages, ImageFolderSplit)):
        return _dataset_batches(data, n, batch_size, seed)
    sharding = EpochSharding(len(data), batch_size, shuffle=True, drop_last=True, seed=seed, max_steps=n)
    order = torch.cat(list(sharding.global_batches(sharding.generator())))
    picked = decode_samples(data, order.tolist()) if isinstance(data, ImageFolderSplit) else data.rows(order)
    loader = TensorLoader(picked, batch_size, shuffle=False, augment=False, mean=ds_cfg["mean"], std=ds_cfg["std"])
    return list(loader)


def _dataset_batches(data: Any, n: int, batch_size: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    from torch.utils.data import DataLoader

    loader = DataLoader(data, batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    batches = []
    for x, y in loader:
        if len(batches) == n:
            break
        batches.append((x, y))
    return batches
