"""Vision Transformers for compressed-activation experiments (torchvision's implementation).

Layer names follow torchvision: ``encoder.layers.encoder_layer_<i>.self_attention`` (attention,
in-projection pooled by ``compress``), ``...mlp.0`` / ``...mlp.3`` (MLP linears), ``heads.head``.
"""

from __future__ import annotations

from typing import Any

import torchvision
from torch import nn
from torchvision.models.vision_transformer import VisionTransformer


def vit_tiny_cifar(num_classes: int = 10, **kwargs: Any) -> nn.Module:
    """A 6-layer, width-192 ViT on 4×4 patches of 32×32 images (64 tokens + class token), ~1.9M
    parameters: an epoch on a few thousand CIFAR-10 images takes minutes on two CPU cores."""
    config: dict[str, Any] = dict(
        image_size=32, patch_size=4, num_layers=6, num_heads=4, hidden_dim=192, mlp_dim=384
    )
    config.update(kwargs)
    return VisionTransformer(num_classes=num_classes, **config)


def vit_b_16(num_classes: int = 1000, **kwargs: Any) -> nn.Module:
    """torchvision ViT-B/16 (224×224, 197 tokens), untrained."""
    return torchvision.models.vit_b_16(weights=None, num_classes=num_classes, **kwargs)
