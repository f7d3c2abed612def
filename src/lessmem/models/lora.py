"""LoRA on any model by the ``model.lora`` option: ``peft.get_peft_model`` with a ``LoraConfig`` of
those settings, so the base weights freeze and only the adapters train. peft (the ``finetune``
extra) is imported only when a model gets LoRA."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


def with_lora(model: nn.Module, options: Mapping[str, Any]) -> nn.Module:
    """``model`` wrapped in a ``peft.PeftModel`` with LoRA adapters; ``options`` are
    ``peft.LoraConfig``'s arguments (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``: module
    names or their last parts, ...). Module and state_dict names gain the prefix ``base_model.model.``."""
    try:
        import peft
    except ImportError as e:
        raise ValueError("model.lora needs peft, which is not installed; install the 'finetune' extra: "
                         "pip install 'lessmem[finetune]'") from e
    try:
        config = peft.LoraConfig(**options)
        return peft.get_peft_model(model, config)
    except (TypeError, ValueError) as e:  # an unknown option, or targets the model does not have
        raise ValueError(f"model.lora {dict(options)} does not fit this model: {e}") from e
