"""Decoding ImageFolder splits into uint8 tensors, cached as ``.pt`` so a split is decoded once.

Decoding 60k small JPEGs every epoch on 2 cores dominates training time, hence the cache; a
few samples (fixed probe batches) are decoded on their own instead of the whole split.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lessmem.experiment.data.images import TensorImages
from lessmem.experiment.data.scan import ImageFolderSplit
from lessmem.experiment.paths import cache_dir
from lessmem.experiment.progress import with_progress
from lessmem.experiment.runtime import atomic_torch_save


def decode_image(path: str, size: int | None) -> np.ndarray:
    """One image file as (H, W, 3) uint8, resized to ``size`` squared unless None."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        if size is not None and im.size != (size, size):
            im = im.resize((size, size), Image.BILINEAR)
        return np.asarray(im, dtype=np.uint8)


def decode_files(files: Sequence[str], size: int | None, desc: str) -> Tensor:
    """Decode images into one uint8 (N, 3, H, W) tensor, showing its progress."""
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        arrays = list(with_progress(pool.map(lambda f: decode_image(f, size), files, chunksize=64), desc, "img",
                                    total=len(files), leave=False))
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def _cache_file(split: ImageFolderSplit, subset: list[int] | None) -> Path:
    root = split.root
    key = (f"{root.resolve()}|{len(split.files)}|{split.image_size}|"
           + ("all" if subset is None else ",".join(map(str, subset))))
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    tag = "all" if subset is None else f"sub{len(subset)}"
    return cache_dir() / f"{root.parent.name}_{root.name}_{tag}_{digest}.pt"


def load_split(split: ImageFolderSplit) -> TensorImages:
    """All samples of ``split``, decoded once and cached. A subset decodes only its own files,
    or slices the whole split's cache when that already exists."""
    full = _cache_file(split, None)
    target = _cache_file(split, split.subset)
    labels = split.sample_labels()
    for path, pick in ((target, None), (full, split.subset)):
        if path.exists():
            images = torch.load(path, weights_only=True)
            return TensorImages(images if pick is None else images[pick], labels, split.classes)
    images = decode_files(split.sample_files(), split.image_size, desc=f"decoding {split.root.name}")
    atomic_torch_save(images, target)
    return TensorImages(images, labels, split.classes)


def decode_samples(split: ImageFolderSplit, idx: Sequence[int]) -> TensorImages:
    """Samples ``idx`` of ``split`` (in that order), decoding only their files; not cached."""
    files = split.sample_files()
    images = decode_files([files[i] for i in idx], split.image_size, desc=f"decoding {split.root.name}")
    return TensorImages(images, split.sample_labels()[list(idx)], split.classes)
