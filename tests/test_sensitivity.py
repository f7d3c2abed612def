"""lessmem.sensitivity: one stock backward predicts every compressed weight gradient."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from torch import nn

import lessmem
from lessmem.sensitivity import SensitivityResult, sensitivity, write_map_yaml


class Block(nn.Module):
    """conv1 and the 1x1 shortcut read the same input, as in ResNet."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, groups=2)
        self.down = nn.Conv2d(cin, cout, 1, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.conv2(self.relu(self.bn1(self.conv1(x)))) + self.down(x))


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        Block(8, 16),
        nn.Conv2d(16, 16, 3, padding="same", dilation=1, padding_mode="reflect"), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5),
    )


def batches(n: int = 2, size: int = 15) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, size, size, generator=g), torch.randint(5, (4,), generator=g)) for _ in range(n)]


def conv_grads(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    return {n: m.weight.grad.clone() for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}


def test_k1_exact_and_pooled_lossy() -> None:
    res = sensitivity(tiny_cnn().train(), batches(), kernels=(1, 2, 4))
    assert res.layers == ["0", "3.conv1", "3.conv2", "3.down", "4"]
    assert res.cosine_mean[:, 0] == pytest.approx(1.0, abs=1e-6)
    assert res.relerr_mean[:, 0] == pytest.approx(0.0, abs=1e-6)
    assert (res.cosine_mean[:, 1:] < 1 - 1e-4).all()
    assert (res.relerr_mean[:, 1:] > 1e-4).all()
    # conv1 and down share their input: one group, so a uniform map stores it once.
    assert res.input_group[1] == res.input_group[3]
    i = res.layers.index("3.conv1")
    assert res.nbytes[i].tolist() == [4 * 8 * 15 * 15 * 4, 4 * 8 * 8 * 8 * 4, 4 * 8 * 4 * 4 * 4]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_prediction_matches_compressed_backward(k: int) -> None:
    """The insight: exact error propagation makes one stock pass predict the compressed one."""
    model = tiny_cnn().train()
    batch = batches(1)[0]
    exact = conv_grads(copy.deepcopy(model), batch)
    compressed = copy.deepcopy(model)
    lessmem.compress(compressed, {"*": k})
    actual = conv_grads(compressed, batch)
    res = sensitivity(copy.deepcopy(model), [batch], kernels=(1, k))
    for i, name in enumerate(res.layers):
        cos = F.cosine_similarity(exact[name].flatten().double(), actual[name].flatten().double(), dim=0)
        assert float(cos) == pytest.approx(res.cosine_mean[i, 1], abs=1e-5), name
        rel = (actual[name] - exact[name]).norm() / exact[name].norm()
        assert float(rel) == pytest.approx(res.relerr_mean[i, 1], abs=1e-4), name


def test_saved_bytes_match_measure_memory() -> None:
    """Differences of the per-layer accounting equal differences of what autograd really keeps."""
    model = tiny_cnn().train()
    x = batches(1)[0][0]
    res = sensitivity(copy.deepcopy(model), [batches(1)[0]], kernels=(1, 2, 4))
    maps = [{}, res.uniform_map(2), {"3.conv1": 4, "3.down": 2, "4": 2}, {"3.conv1": 2, "0": 4}]
    measured = []
    for m in maps:
        lessmem.compress(model, m or None)
        measured.append(lessmem.measure_memory(model, x).total_bytes)
    lessmem.uncompress(model)
    for m, total in zip(maps[1:], measured[1:], strict=True):
        assert res.baseline_bytes() - res.saved_bytes(m) == measured[0] - total


def test_buffers_and_grads_untouched() -> None:
    model = tiny_cnn().train()
    before = copy.deepcopy(model.state_dict())
    sensitivity(model, batches(1), kernels=(1, 2))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_make_map_budget_and_min_cosine(tmp_path) -> None:
    res = sensitivity(tiny_cnn().train(), batches(), kernels=(1, 2, 4, 8))
    base = res.baseline_bytes()
    for frac in (0.8, 0.5, 0.2):
        kmap = res.make_map(budget_bytes=frac)
        assert res.saved_bytes(kmap) <= frac * base
    kmap = res.make_map(budget_bytes=0.5 * base)
    assert res.saved_bytes(kmap) <= 0.5 * base
    floor = float(res.cosine_mean[:, 1].min())  # every layer can take 2x2 at least
    kmap = res.make_map(min_cosine=floor)
    assert all(c >= floor for c in res.layer_cosines(kmap).values())
    assert res.saved_bytes(kmap) < base
    grouped = res.make_map(budget_bytes=0.5, groups=["3.*"])
    assert len({grouped[n] for n in ("3.conv1", "3.conv2", "3.down")}) == 1
    path = write_map_yaml(kmap, tmp_path / "conf" / "compression" / "gen.yaml")
    cfg = yaml.safe_load(path.read_text())
    assert cfg["map"] == kmap and cfg["norm_storage"] == "native" and cfg["exact_companions"] is True
    lessmem.compress(tiny_cnn(), cfg["map"])  # usable as a compression map


def test_save_roundtrip(tmp_path) -> None:
    res = sensitivity(tiny_cnn().train(), batches(1), kernels=(1, 2))
    paths = res.save(tmp_path)
    assert {p.name for p in paths.values()} == {"sensitivity.csv", "sensitivity.json", "sensitivity.png"}
    with Image.open(paths["png"]) as im:
        im.verify()
    back = SensitivityResult.load(tmp_path)
    assert back.layers == res.layers and back.nbytes.tolist() == res.nbytes.tolist()
    assert back.mean_cosine({"4": 2}) == pytest.approx(res.mean_cosine({"4": 2}))
