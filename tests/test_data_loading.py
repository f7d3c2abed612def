"""Data: fixed probe batches decode only their own files, and the DataLoader path shards its
batches over ranks like the tensor loader (N ranks with batch B == one process with batch N*B)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lessmem.experiment import compose_config, default_data_root
from lessmem.experiment.data import DatasetLoader, TensorLoader, build_datasets, fixed_batches
from lessmem.experiment.data import cache as decode_cache
from lessmem.experiment.data.datasets import dataset_splits


def image_folder(root: Path, per_class: dict[str, int]) -> None:
    """``root/{train,test}/<class>/*.png``: 32x32 images of random pixels."""
    rng = np.random.default_rng(0)
    for split, scale in (("train", 1), ("test", 2)):
        for cls, n in per_class.items():
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(max(1, n // scale)):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """Every file decoded from now on (the cache goes to a fresh folder)."""
    monkeypatch.setenv("LESSMEM_CACHE", str(tmp_path / "cache"))
    seen: list[str] = []
    decode = decode_cache.decode_image

    def counting(path: str, size: int | None) -> np.ndarray:
        seen.append(path)
        return decode(path, size)

    monkeypatch.setattr(decode_cache, "decode_image", counting)
    return seen


def test_decoding_without_a_terminal_logs_lines_not_a_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Under pytest stderr is not a terminal, as in a log file or a cluster job: no tqdm bar (its
    carriage returns), but a line at the start, at each quarter and at the end, with counts and rate."""
    image_folder(tmp_path / "data", {"cat": 8})
    files = sorted(str(f) for f in (tmp_path / "data" / "train" / "cat").iterdir())
    with caplog.at_level("INFO"):
        images = decode_cache.decode_files(files, None, desc="decoding train")
    assert images.shape == (8, 3, 32, 32)
    captured = capsys.readouterr()
    lines = [r.getMessage() for r in caplog.records if r.name == "lessmem.experiment.progress"]
    assert "\r" not in captured.err + captured.out + caplog.text
    assert lines[0] == "decoding train: 0/8 img"
    assert [line.split(",")[0] for line in lines[1:-1]] == [f"decoding train: {n}/8 img ({n * 100 // 8}%)"
                                                           for n in (2, 4, 6)]
    assert lines[-1].startswith("decoding train: 8/8 img in ") and lines[-1].endswith(" img/s")


def test_progress_is_a_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                         caplog: pytest.LogCaptureFixture) -> None:
    from lessmem.experiment import with_progress

    monkeypatch.setattr("lessmem.experiment.progress.on_terminal", lambda: True)
    with caplog.at_level("INFO"):
        assert list(with_progress(range(3), "work", "item")) == [0, 1, 2]
    assert "work: 100%" in capsys.readouterr().err and not caplog.records

def test_fixed_batches_decode_only_their_files(tmp_path: Path, decoded: list[str]) -> None:
    image_folder(tmp_path / "data", {"cat": 20, "dog": 20})
    cfg = compose_config([f"dataset.root={tmp_path / 'data'}", "seed=3"])
    batches = fixed_batches(cfg.dataset, 1, 8, seed=3)
    assert len(decoded) == 8 and len(set(decoded)) == 8
    # The same images as the first batch of an un-augmented training loader over the whole split.
    train, _ = build_datasets(cfg.dataset)
    assert len(decoded) == 8 + 40 + 20
    loader = TensorLoader(train, 8, shuffle=True, augment=False, mean=cfg.dataset.mean, std=cfg.dataset.std,
                          seed=3, drop_last=True)
    x, y = next(iter(loader))
    assert len(batches) == 1 and torch.equal(batches[0][0], x) and torch.equal(batches[0][1], y)
    with pytest.raises(ValueError, match="only 2 batches of 8 \\(val split\\), asked for 3"):
        fixed_batches(cfg.dataset, 3, 8, split="val")


def test_dataset_loader_shards_equal_global_batch() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(20.0)[:, None], torch.arange(20))
    full = DatasetLoader(data, 6, shuffle=True, workers=0, seed=3)
    shards = [DatasetLoader(data, 3, shuffle=True, workers=0, seed=3, rank=r, world_size=2) for r in range(2)]
    first_labels = []
    for epoch in (0, 1):
        for loader in (full, *shards):
            loader.set_epoch(epoch)
        one, parts = list(full), [list(s) for s in shards]
        assert len(one) == len(full) == 3 and all(len(p) == 3 for p in parts)
        for step, (_, y) in enumerate(one):
            assert torch.equal(torch.cat([parts[0][step][1], parts[1][step][1]]), y)
        first_labels.append(one[0][1].tolist())
    assert first_labels[0] != first_labels[1]  # a fresh order every epoch


def test_default_data_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LESSMEM_DATA", "/data/here")
    assert default_data_root("cifar10") == Path("/data/here/cifar10")
    assert compose_config(["dataset=imagenet"]).dataset.root == "/data/here/imagenet"
    monkeypatch.delenv("LESSMEM_DATA")
    assert compose_config([]).dataset.root == "../shared/data/cifar10"


def test_train_holdout_validation_is_disjoint_and_balanced(tmp_path: Path, decoded: list[str]) -> None:
    """``val_source=train_holdout``: validation images come from the train folder, never from the
    training subset nor the test folder, balanced over classes."""
    image_folder(tmp_path / "data", {"cat": 20, "dog": 20})
    over = [f"dataset.root={tmp_path / 'data'}", "dataset.train_subset=16", "dataset.val_subset=10",
            "dataset.val_source=train_holdout"]
    train, val = dataset_splits(compose_config(over).dataset)
    assert val.root == train.root and val.root.name == "train"
    assert len(train.subset) == 16 and len(val.subset) == 10
    assert not set(train.subset) & set(val.subset)
    assert sorted(val.sample_labels().tolist()) == [0] * 5 + [1] * 5
    _, everything = dataset_splits(compose_config(over[:-2] + ["dataset.val_source=train_holdout"]).dataset)
    assert sorted(everything.subset + train.subset) == list(range(40))
    _, val_images = build_datasets(compose_config(over).dataset)
    assert len(val_images) == 10 and not any("/test/" in p for p in decoded)
    with pytest.raises(ValueError, match="needs dataset.train_subset"):
        dataset_splits(compose_config(over[:1] + over[-1:]).dataset)
    with pytest.raises(ValueError, match="val_source must be one of"):
        dataset_splits(compose_config([*over[:1], "dataset.val_source=valid"]).dataset)
