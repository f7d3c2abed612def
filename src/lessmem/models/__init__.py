"""Model builders by name (torchvision, CIFAR ResNets, ViTs); torch only."""

from lessmem.models.registry import MODELS, build_model

__all__ = ["MODELS", "build_model"]
