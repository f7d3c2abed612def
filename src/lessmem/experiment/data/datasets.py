"""The datasets of the ``dataset`` config group: CIFAR-10 (ImageFolder files, or torchvision's
download), ImageNet (streamed through PIL transforms), synthetic images and byte-level text
(the Python standard library's source)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lessmem.experiment.data.cache import load_split
from lessmem.experiment.data.images import TensorImages
from lessmem.experiment.data.scan import (
    ImageFolderSplit,
    balanced_subset,
    holdout_split,
    image_folder_split,
)
from lessmem.experiment.data.text import stdlib_text
from lessmem.experiment.paths import DATA_ENV, DEFAULT_DATA_DIR, resolve_path

DATASETS = ("cifar10", "imagenet", "stdlib_text", "synthetic")
VAL_SOURCES = ("test", "train_holdout")


def missing_data_error(root: Path, name: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{name} data not found at {root}. Put it there in the ImageFolder layout "
        f"({root}/train/<class>/*.jpg and {root}/test/<class>/*.jpg; the default root is "
        f"${DATA_ENV}/{name}, else {DEFAULT_DATA_DIR}/{name}), point dataset.root=... (or "
        f"{DATA_ENV}=...) at it"
        + (", or set dataset.download=true on a machine with internet access." if name == "cifar10" else ".")
    )


def dataset_splits(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    """(train, val) of the ``dataset`` config group, before any decoding: ImageFolderSplit for
    CIFAR-10 files, TensorImages for downloaded CIFAR-10 and synthetic data, torchvision
    ImageFolder datasets for ImageNet, TokenStreams for text."""
    name = cfg.get("name")
    if name == "cifar10":
        return _cifar10(cfg)
    if name == "synthetic":
        return _synthetic(cfg)
    if name == "imagenet":
        return _imagenet(cfg)
    if name == "stdlib_text":
        return stdlib_text(cfg)
    raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")


def build_datasets(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    """(train, val) ready to load: TensorImages for cifar10 and synthetic (ImageFolder files
    decoded through the cache), torchvision ImageFolder datasets for imagenet."""
    return tuple(load_split(s) if isinstance(s, ImageFolderSplit) else s for s in dataset_splits(cfg))


def _cifar10(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    root = resolve_path(cfg["root"])
    size = cfg.get("image_size") or 32
    seed = int(cfg.get("subset_seed", 0))
    source = cfg.get("val_source", "test")
    if source not in VAL_SOURCES:
        raise ValueError(f"dataset.val_source must be one of {', '.join(VAL_SOURCES)}, got {source!r}")
    if not (root / "train").is_dir():
        if not cfg.get("download", False):
            raise missing_data_error(root, "cifar10")
        if source != "test":
            raise ValueError("dataset.val_source=train_holdout reads the ImageFolder files; the download path has test only")
        return _cifar10_download(root, cfg, seed)
    if not (root / "test").is_dir():
        raise missing_data_error(root, "cifar10")
    resize = None if size == 32 else size
    train = image_folder_split(root / "train", resize, cfg.get("train_subset"), seed)
    if source == "train_holdout":
        return train, holdout_split(train, cfg.get("val_subset"), seed)
    return train, image_folder_split(root / "test", resize, cfg.get("val_subset"), seed)


def _cifar10_download(root: Path, cfg: Mapping[str, Any], seed: int) -> tuple[TensorImages, TensorImages]:
    from torchvision.datasets import CIFAR10

    out = []
    for train, key in ((True, "train_subset"), (False, "val_subset")):
        ds = CIFAR10(str(root), train=train, download=True)
        images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        labels = torch.tensor(ds.targets, dtype=torch.int64)
        idx = balanced_subset(labels.tolist(), cfg.get(key), seed)
        if idx is not None:
            images, labels = images[idx], labels[idx]
        out.append(TensorImages(images, labels, list(ds.classes)))
    return out[0], out[1]


def _synthetic(cfg: Mapping[str, Any]) -> tuple[TensorImages, TensorImages]:
    # Labels are learnable (class-dependent mean) so smoke runs can show accuracy moving.
    n_cls, size = int(cfg["num_classes"]), int(cfg["image_size"])
    g = torch.Generator().manual_seed(int(cfg.get("seed", 0)))

    def make(n: int) -> TensorImages:
        labels = torch.randint(n_cls, (n,), generator=g)
        base = (labels.float() / max(n_cls - 1, 1) * 128 + 64).view(-1, 1, 1, 1)
        noise = torch.randn(n, 3, size, size, generator=g) * 40
        images = (base + noise).clamp(0, 255).to(torch.uint8)
        return TensorImages(images, labels, [str(i) for i in range(n_cls)])

    train = make(int(cfg.get("train_subset") or cfg["size"]))  # first: val continues its stream
    return train, make(int(cfg.get("val_subset") or cfg.get("val_size") or max(1, cfg["size"] // 5)))


def _imagenet(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    from torch.utils.data import Subset
    from torchvision import datasets, transforms

    root = resolve_path(cfg["root"])
    if not (root / "train").is_dir():
        raise missing_data_error(root, "imagenet")
    size = int(cfg.get("image_size") or 224)
    norm = transforms.Normalize(list(cfg["mean"]), list(cfg["std"]))
    train_tf = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()] if cfg.get("augment", True) else [
        transforms.Resize(int(size * 256 / 224)), transforms.CenterCrop(size)]
    val_tf = [transforms.Resize(int(size * 256 / 224)), transforms.CenterCrop(size)]
    train = datasets.ImageFolder(str(root / "train"), transforms.Compose([*train_tf, transforms.ToTensor(), norm]))
    val = datasets.ImageFolder(str(root / "val"), transforms.Compose([*val_tf, transforms.ToTensor(), norm]))
    seed = int(cfg.get("subset_seed", 0))
    out = []
    for ds, key in ((train, "train_subset"), (val, "val_subset")):
        idx = balanced_subset(ds.targets, cfg.get(key), seed)
        out.append(ds if idx is None else Subset(ds, idx))
    return out[0], out[1]
