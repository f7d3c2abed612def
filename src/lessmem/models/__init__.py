"""Model builders by name (torchvision, CIFAR ResNets, ViTs, small HF causal LMs) and LoRA on any of
them; torch only (transformers is imported when a language model is built, peft when LoRA is
applied)."""

from lessmem.models.lora import with_lora
from lessmem.models.registry import MODELS, build_model

__all__ = ["MODELS", "build_model", "with_lora"]
