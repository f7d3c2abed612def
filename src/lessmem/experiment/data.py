"""Datasets as uint8 tensors in memory, augmented and normalized in batches.

Decoding 60k small JPEGs every epoch on 2 cores dominates training time, so ImageFolder data
with small images is decoded once into a ``(N, 3, H, W)`` uint8 tensor cached as ``.pt``. Large
images (ImageNet) stream through a normal DataLoader with PIL transforms instead.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from lessmem.experiment.paths import cache_dir, resolve_path

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
DATASETS = ("cifar10", "imagenet", "synthetic")


@dataclass
class TensorImages:
    """Images (N, 3, H, W) uint8 and labels (N,) int64, kept on the CPU."""

    images: Tensor
    labels: Tensor
    classes: list[str]

    def __len__(self) -> int:
        return len(self.labels)


# --------------------------------------------------------------------------- files and subsets


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


# --------------------------------------------------------------------------- decoding and cache


def _decode(path: str, size: int | None) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if size is not None and im.size != (size, size):
            im = im.resize((size, size), Image.BILINEAR)
        return np.asarray(im, dtype=np.uint8)


def decode_files(files: Sequence[str], size: int | None, desc: str) -> Tensor:
    """Decode images into one uint8 (N, 3, H, W) tensor, with a progress bar."""
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        arrays = list(
            tqdm(pool.map(lambda f: _decode(f, size), files, chunksize=64), total=len(files),
                 desc=desc, unit="img", leave=False)
        )
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def _cache_file(root: Path, n_files: int, size: int | None, subset: list[int] | None) -> Path:
    key = f"{root.resolve()}|{n_files}|{size}|" + ("all" if subset is None else ",".join(map(str, subset)))
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    tag = "all" if subset is None else f"sub{len(subset)}"
    return cache_dir() / f"{root.parent.name}_{root.name}_{tag}_{digest}.pt"


def load_image_folder(
    root: Path, size: int | None = None, subset: int | None = None, subset_seed: int = 0, cache: bool = True
) -> TensorImages:
    """Decode ``root`` (ImageFolder) once, cached. A subset decodes only its own files, or slices
    the full cache when that already exists."""
    files, labels, classes = scan_image_folder(root)
    idx = balanced_subset(labels, subset, subset_seed)
    full = _cache_file(root, len(files), size, None)
    target = full if idx is None else _cache_file(root, len(files), size, idx)
    labels_t = torch.tensor(labels, dtype=torch.int64)
    for path, pick in ((target, None), (full, idx)):
        if cache and path.exists():
            images = torch.load(path, weights_only=True)
            if pick is not None:
                images = images[pick]
            return TensorImages(images, labels_t if idx is None else labels_t[idx], classes)
    chosen = files if idx is None else [files[i] for i in idx]
    images = decode_files(chosen, size, desc=f"decoding {root.name}")
    if cache:
        _atomic_save(images, target)
    return TensorImages(images, labels_t if idx is None else labels_t[idx], classes)


def _atomic_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- datasets


def _missing_data_error(root: Path, name: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{name} data not found at {root}. Put it there in the ImageFolder layout "
        f"({root}/train/<class>/*.jpg and {root}/test/<class>/*.jpg; the default root is "
        f"$LESSMEM_DATA/{name}, else ../shared/data/{name}), point dataset.root=... (or "
        f"LESSMEM_DATA=...) at it"
        + (", or set dataset.download=true on a machine with internet access." if name == "cifar10" else ".")
    )


def _cifar10(cfg: Mapping[str, Any]) -> tuple[TensorImages, TensorImages]:
    root = resolve_path(cfg["root"])
    size = cfg.get("image_size") or 32
    seed = int(cfg.get("subset_seed", 0))
    if not (root / "train").is_dir():
        if not cfg.get("download", False):
            raise _missing_data_error(root, "cifar10")
        return _cifar10_download(root, cfg, seed)
    resize = None if size == 32 else size
    train = load_image_folder(root / "train", resize, cfg.get("train_subset"), seed)
    if not (root / "test").is_dir():
        raise _missing_data_error(root, "cifar10")
    val = load_image_folder(root / "test", resize, cfg.get("val_subset"), seed)
    return train, val


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

    return make(int(cfg.get("train_subset") or cfg["size"])), make(int(cfg.get("val_subset") or cfg.get("val_size") or max(1, cfg["size"] // 5)))


def build_datasets(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    """``cfg`` is the ``dataset`` config group. Returns (train, val): TensorImages for cifar10 and
    synthetic, torchvision ImageFolder datasets for imagenet."""
    name = cfg.get("name")
    if name == "cifar10":
        return _cifar10(cfg)
    if name == "synthetic":
        return _synthetic(cfg)
    if name == "imagenet":
        return _imagenet(cfg)
    raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")


def _imagenet(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    from torch.utils.data import Subset
    from torchvision import datasets, transforms

    root = resolve_path(cfg["root"])
    if not (root / "train").is_dir():
        raise _missing_data_error(root, "imagenet")
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


# --------------------------------------------------------------------------- loaders


def random_crop_flip(x: Tensor, pad: int, g: torch.Generator, n: int | None = None,
                     rows_of: slice | None = None) -> Tensor:
    """Per-sample random crop after zero-padding by ``pad`` and random horizontal flip, batched.

    ``x`` may be rows ``rows_of`` of a batch of ``n`` images (one rank's shard): the random numbers
    are drawn for the whole batch, so the shards of N ranks together equal one process's batch."""
    n = len(x) if n is None else n
    pick = slice(None) if rows_of is None else rows_of
    _, _, h, w = x.shape
    if pad > 0:
        padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
        oy = torch.randint(0, 2 * pad + 1, (n,), generator=g)[pick]
        ox = torch.randint(0, 2 * pad + 1, (n,), generator=g)[pick]
        n_x = len(x)
        rows = (oy[:, None] + torch.arange(h))[:, None, :, None]  # (n,1,h,1)
        cols = (ox[:, None] + torch.arange(w))[:, None, None, :]  # (n,1,1,w)
        x = padded[torch.arange(n_x)[:, None, None, None], torch.arange(x.shape[1])[None, :, None, None], rows, cols]
    flip = (torch.rand(n, generator=g) < 0.5)[pick]
    return torch.where(flip[:, None, None, None], x.flip(3), x)


class TensorLoader:
    """Batches from TensorImages: seeded shuffle + augmentation per epoch (``set_epoch``), so a
    run resumed at epoch e sees exactly the batches of an uninterrupted run.

    Distributed (``world_size`` > 1): every rank builds the same global batch of
    ``world_size * batch_size`` images (same seed) and yields its own ``batch_size`` rows, so N
    ranks with batch B see exactly the batches of one process with batch N*B. A rank whose shard
    of a short last (eval) batch is empty skips it."""

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
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.data, self.batch_size = data, batch_size
        self.rank, self.world_size, self.global_batch = rank, world_size, batch_size * world_size
        self.shuffle, self.augment, self.drop_last = shuffle, augment, drop_last
        self.mean = torch.tensor(list(mean)).view(1, -1, 1, 1) * 255
        self.std = torch.tensor(list(std)).view(1, -1, 1, 1) * 255
        self.seed, self.epoch, self.max_steps = seed, 0, max_steps
        self.pad = max(1, data.images.shape[-1] // 8)  # 4 px at 32x32

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.data)
        steps = n // self.global_batch if self.drop_last else math.ceil(n / self.global_batch)
        return steps if self.max_steps is None else min(steps, self.max_steps)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        n = len(self.data)
        order = torch.randperm(n, generator=g) if self.shuffle else torch.arange(n)
        for step in range(len(self)):
            batch = order[step * self.global_batch : (step + 1) * self.global_batch]
            mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
            idx = batch[mine]
            x = self.data.images[idx]
            if self.augment:  # draws for the whole global batch: the same stream on every rank
                x = random_crop_flip(x, self.pad, g, n=len(batch), rows_of=mine)
            if len(idx) == 0:
                continue
            yield (x.float() - self.mean) / self.std, self.data.labels[idx]


def build_loaders(
    cfg: Mapping[str, Any], batch_size: int, eval_batch_size: int, seed: int, max_steps: int | None = None,
    rank: int = 0, world_size: int = 1,
) -> tuple[Any, Any]:
    """(train_loader, val_loader) for the ``dataset`` config group. Batch sizes are per rank;
    with ``world_size`` > 1 each loader yields rank ``rank``'s shard of every global batch."""
    train, val = build_datasets(cfg)
    if isinstance(train, TensorImages):
        common = {"mean": cfg["mean"], "std": cfg["std"], "rank": rank, "world_size": world_size}
        if len(train) < batch_size * world_size:
            raise ValueError(f"batch_size {batch_size} x {world_size} ranks exceeds the {len(train)} training images")
        return (
            TensorLoader(train, batch_size, shuffle=True, augment=bool(cfg.get("augment", True)),
                         seed=seed, drop_last=True, max_steps=max_steps, **common),
            TensorLoader(val, eval_batch_size, shuffle=False, augment=False, **common),
        )
    return _torch_loaders(train, val, cfg, batch_size, eval_batch_size, seed, max_steps, rank, world_size)


class _EpochSeededLoader:
    """DataLoader wrapper with the TensorLoader interface (set_epoch, max_steps). Distributed:
    the same seeded order on every rank, each loading only its rows of each global batch."""

    def __init__(self, ds: Any, batch_size: int, shuffle: bool, workers: int, seed: int, max_steps: int | None,
                 rank: int = 0, world_size: int = 1):
        self.ds, self.batch_size, self.shuffle = ds, batch_size, shuffle
        self.workers, self.seed, self.epoch, self.max_steps = workers, seed, 0, max_steps
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        gb = self.batch_size * self.world_size
        steps = len(self.ds) // gb if self.shuffle else math.ceil(len(self.ds) / gb)
        return steps if self.max_steps is None else min(steps, self.max_steps)

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        from torch.utils.data import DataLoader

        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        if self.world_size > 1:
            gb, n = self.batch_size * self.world_size, len(self.ds)
            order = torch.randperm(n, generator=g) if self.shuffle else torch.arange(n)
            mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
            batches = [b for s in range(len(self)) if len(b := order[s * gb : (s + 1) * gb][mine].tolist())]
            yield from DataLoader(self.ds, batch_sampler=batches, num_workers=self.workers, pin_memory=True)
            return
        loader = DataLoader(self.ds, self.batch_size, shuffle=self.shuffle, generator=g,
                            num_workers=self.workers, drop_last=self.shuffle, pin_memory=True,
                            persistent_workers=False)
        for step, batch in enumerate(loader):
            if step >= len(self):
                break
            yield batch


def _torch_loaders(train: Any, val: Any, cfg: Mapping[str, Any], batch_size: int, eval_batch_size: int,
                   seed: int, max_steps: int | None, rank: int = 0, world_size: int = 1) -> tuple[Any, Any]:
    workers = int(cfg.get("workers", 0))
    return (_EpochSeededLoader(train, batch_size, True, workers, seed, max_steps, rank, world_size),
            _EpochSeededLoader(val, eval_batch_size, False, workers, seed, None, rank, world_size))


def fixed_batches(cfg: Any, n: int, batch_size: int, split: str = "train", seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """The first ``n`` seeded-shuffled, un-augmented batches of the configured dataset."""
    from omegaconf import OmegaConf

    ds_cfg = OmegaConf.to_container(cfg.dataset, resolve=True)
    train, val = build_datasets(ds_cfg)
    data = train if split == "train" else val
    if not isinstance(data, TensorImages):
        from torch.utils.data import DataLoader

        g = torch.Generator().manual_seed(seed)
        loader = DataLoader(data, batch_size, shuffle=True, generator=g)
    else:
        loader = TensorLoader(data, batch_size, shuffle=True, augment=False, mean=ds_cfg["mean"],
                              std=ds_cfg["std"], seed=seed, drop_last=True)
    batches = []
    for i, batch in enumerate(loader):
        if i >= n:
            break
        batches.append((batch[0], batch[1]))
    if len(batches) < n:
        raise ValueError(f"dataset has only {len(batches)} batches of {batch_size} ({split} split), asked for {n}")
    return batches
