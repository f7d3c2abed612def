"""lessmem.sensitivity, kernel-only (the menu with native storage): one stock backward predicts
every compressed weight gradient, and the bytes of every map."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lessmem
from lessmem.sensitivity import MenuOptions, MenuResult, measure_menu


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


def kernel_menu(model: nn.Module, data, kernels=(1, 2, 4)) -> MenuResult:
    return measure_menu(model, data, MenuOptions.kernel_only(kernels))


def conv_items(menu: MenuResult) -> dict:
    return {i.name: i for i in menu.items if i.kind == "conv"}


def test_k1_exact_and_pooled_lossy() -> None:
    menu = kernel_menu(tiny_cnn().train(), batches())
    items = conv_items(menu)
    assert list(items) == ["0", "3.conv1", "3.conv2", "3.down", "4"]
    assert {i.kind for i in menu.items} == {"conv", "norm"}  # BatchNorm inputs: native only
    assert all(i.options == ["native"] for i in menu.items if i.kind == "norm")
    for item in items.values():
        assert item.options == ["1", "2", "4"]
        assert item.mean("cosine")[0] == pytest.approx(1.0, abs=1e-6)
        assert item.mean("grad_error")[0] == pytest.approx(0.0, abs=1e-12)
        assert all(c < 1 - 1e-4 for c in item.mean("cosine")[1:])
    # conv1 and down share their input: one group, so a uniform map stores it once.
    assert items["3.conv1"].group == items["3.down"].group
    assert items["3.conv1"].nbytes == [4 * 8 * 15 * 15 * 4, 4 * 8 * 8 * 8 * 4, 4 * 8 * 4 * 4 * 4]


@pytest.mark.parametrize("k", [2, 3, 4])
def test_prediction_matches_compressed_backward(k: int) -> None:
    """The insight: exact error propagation makes one stock pass predict the compressed one."""
    model = tiny_cnn().train()
    batch = batches(1)[0]
    exact = conv_grads(copy.deepcopy(model), batch)
    compressed = copy.deepcopy(model)
    lessmem.compress(compressed, {"*": k})
    actual = conv_grads(compressed, batch)
    for name, item in conv_items(kernel_menu(copy.deepcopy(model), [batch], kernels=(1, k))).items():
        cos = F.cosine_similarity(exact[name].flatten().double(), actual[name].flatten().double(), dim=0)
        assert float(cos) == pytest.approx(item.mean("cosine")[1], abs=1e-5), name


def test_saved_bytes_match_measure_memory() -> None:
    """The menu's bytes of a map are what autograd really keeps under it."""
    model = tiny_cnn().train()
    x = batches(1)[0][0]
    menu = kernel_menu(copy.deepcopy(model), [batches(1)[0]])
    for m in ({"*": 2}, {"3.conv1": 4, "3.down": 2, "4": 2}, {"3.conv1": 2, "0": 4}):
        lessmem.compress(model, m)
        assert menu.score(lessmem.CompressionPlan(m))["bytes"] == lessmem.measure_memory(model, x).total_bytes, m
        lessmem.uncompress(model)


def test_buffers_and_grads_untouched() -> None:
    model = tiny_cnn().train()
    before = copy.deepcopy(model.state_dict())
    kernel_menu(model, batches(1), kernels=(1, 2))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_kernel_map_fits_the_budget_and_compresses() -> None:
    menu = kernel_menu(tiny_cnn().train(), batches(), kernels=(1, 2, 4, 8))
    for frac in (0.9, 0.7, 0.5):
        choice = menu.make_map(frac)
        assert choice.score["ratio"] <= frac
        assert choice.plan.norm_storage == "native" and choice.plan.act_storage == "native"
        assert all(o in ("1", "2", "4", "8") for o in choice.plan.map.values())
        lessmem.compress(tiny_cnn(), choice.plan)  # usable as it is
