"""Model registry: ``build_model(name, num_classes, **kwargs)``. Torchvision models start untrained;
the language models (``num_classes``: the vocabulary) need HF transformers, the ``zoo`` extra."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

from lessmem.models import causal_lm, vit


class ShortcutA(nn.Module):
    """He et al. (2016) option A: subsample spatially and zero-pad the new channels (no weights)."""

    def __init__(self, out_channels: int, stride: int) -> None:
        super().__init__()
        self.out_channels, self.stride = out_channels, stride

    def forward(self, x: Tensor) -> Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        extra = self.out_channels - x.shape[1]
        return F.pad(x, (0, 0, 0, 0, extra // 2, extra - extra // 2))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU(inplace=True)  # modules, not F.relu: compress swaps them to 1-bit masks
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            if shortcut == "A":
                self.shortcut = ShortcutA(cout, stride)
            elif shortcut == "B":
                self.shortcut = nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )
            else:
                raise ValueError(f"resnet20 shortcut must be 'A' or 'B', got {shortcut!r}")

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """CIFAR ResNet-(6n+2) of He et al. (2016): 3 stages of 16/32/64 channels."""

    def __init__(self, depth: int = 20, num_classes: int = 10, shortcut: str = "A", width: int = 16) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2, got {depth}")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        stages, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            blocks = []
            for j in range(n):
                blocks.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1, shortcut))
                cin = cout
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet20(num_classes: int = 10, **kwargs: Any) -> nn.Module:
    return CifarResNet(20, num_classes, **kwargs)


def resnet18_cifar(num_classes: int = 10, **kwargs: Any) -> nn.Module:
    """torchvision resnet18 with a 3x3/stride-1 stem and no max-pool, for 32x32 inputs."""
    model = torchvision.models.resnet18(weights=None, num_classes=num_classes, **kwargs)
    model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _torchvision(name: str) -> Callable[..., nn.Module]:
    def build(num_classes: int = 1000, **kwargs: Any) -> nn.Module:
        return getattr(torchvision.models, name)(weights=None, num_classes=num_classes, **kwargs)

    build.__name__ = name
    return build


MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet20": resnet20,
    "resnet18_cifar": resnet18_cifar,
    **{n: _torchvision(n) for n in ("resnet18", "resnet34", "resnet50", "vgg11_bn", "mobilenet_v2")},
    "vit_b_16": vit.vit_b_16,
    "vit_tiny_cifar": vit.vit_tiny_cifar,
    "tiny_llama": causal_lm.tiny_llama,
    "tiny_gpt2": causal_lm.tiny_gpt2,
}


def build_model(name: str, num_classes: int, **kwargs: Any) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}")
    return MODELS[name](num_classes=num_classes, **kwargs)

