"""The files of an ImageFolder split (``root/<class>/*.jpg``) and balanced subsets of them,
without decoding anything."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")


def scan_image_folder(root: Path) -> tuple[list[str], list[int], list[str]]:
    """ImageFolder layout ``root/<class>/*.jpg``; sorted so indices are stable across machines.
    Plain strings: building 60k Path objects costs more than the scan itself."""
    classes = sorted(d.name for d in os.scandir(root) if d.is_dir())
    if not classes:
        raise FileNotFoundError(f"no class folders in {root} (expected {root}/<class>/*.jpg)")
    files: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        names = sorted(e.name for e in os.scandir(root / cls) if e.name.lower().endswith(IMAGE_EXTS))
        files += [os.path.join(root, cls, n) for n in names]
        labels += [label] * len(names)
    return files, labels, classes


def balanced_subset(labels: Sequence[int], size: int | None, seed: int = 0) -> list[int] | None:
    """Indices of ``size`` samples, as equal per class as possible, chosen by a seeded shuffle
    within each class; sorted. None (or size >= N) keeps everything."""
    if size is None or size >= len(labels):
        return None
    if size <= 0:
        raise ValueError(f"subset size must be positive, got {size}")
    labels_t = torch.as_tensor(list(labels))
    classes = torch.unique(labels_t).tolist()
    g = torch.Generator().manual_seed(seed)
    per_class = {c: (labels_t == c).nonzero().flatten() for c in classes}
    per_class = {c: idx[torch.randperm(len(idx), generator=g)] for c, idx in per_class.items()}
    chosen: list[int] = []
    quota = {c: size // len(classes) + (i < size % len(classes)) for i, c in enumerate(classes)}
    for c in classes:
        chosen += per_class[c][: quota[c]].tolist()
    return sorted(chosen)


@dataclass(frozen=True)
class ImageFolderSplit:
    """One split of an ImageFolder (all its files, the chosen subset) before decoding; its
    samples are the subset's files in order. ``image_size``: decoded images are resized to
    ``image_size`` squared (None: as stored)."""

    root: Path
    files: list[str]
    labels: list[int]
    classes: list[str]
    subset: list[int] | None
    image_size: int | None

    def __len__(self) -> int:
        return len(self.files) if self.subset is None else len(self.subset)

    def sample_files(self) -> list[str]:
        return self.files if self.subset is None else [self.files[i] for i in self.subset]

    def sample_labels(self) -> torch.Tensor:
        labels = torch.tensor(self.labels, dtype=torch.int64)
        return labels if self.subset is None else labels[self.subset]


def image_folder_split(root: Path, image_size: int | None, subset: int | None,
                       subset_seed: int) -> ImageFolderSplit:
    """Scan ``root`` and choose a balanced ``subset`` of it (None: everything)."""
    files, labels, classes = scan_image_folder(root)
    return ImageFolderSplit(root, files, labels, classes, balanced_subset(labels, subset, subset_seed),
                            image_size)


def holdout_split(train: ImageFolderSplit, size: int | None, subset_seed: int) -> ImageFolderSplit:
    """A balanced ``size`` of the files of ``train``'s folder that ``train``'s subset leaves out
    (None: all of them): a validation set that a search can select on without touching the test set."""
    if train.subset is None:
        raise ValueError("dataset.val_source=train_holdout needs dataset.train_subset: the whole train "
                         "folder is training data, nothing is left to hold out")
    taken = set(train.subset)
    rest = [i for i in range(len(train.files)) if i not in taken]
    pick = balanced_subset([train.labels[i] for i in rest], size, subset_seed)
    return replace(train, subset=rest if pick is None else [rest[j] for j in pick])
