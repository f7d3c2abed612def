"""Model builders by name (torchvision, CIFAR ResNets, ViTs, small HF causal LMs); torch only
(transformers is imported when a language model is built)."""

from lessmem.models.registry import MODELS, build_model

__all__ = ["MODELS", "build_model"]
