"""Datasets as uint8 tensors in memory, augmented and normalized in batches; large images
(ImageNet) stream through a torch DataLoader with PIL transforms instead."""

from lessmem.experiment.data.datasets import build_datasets
from lessmem.experiment.data.fixed import fixed_batches
from lessmem.experiment.data.images import TensorImages
from lessmem.experiment.data.loaders import (
    DatasetLoader,
    RandomBlockLoader,
    SequentialBlockLoader,
    TensorLoader,
    build_loaders,
)

__all__ = [
    "DatasetLoader",
    "RandomBlockLoader",
    "SequentialBlockLoader",
    "TensorImages",
    "TensorLoader",
    "build_datasets",
    "build_loaders",
    "fixed_batches",
]
