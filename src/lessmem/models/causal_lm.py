"""Small causal language models built from HF transformers configs (random init, nothing
downloaded), called like any other model here: token ids (batch, seq) in, logits out."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from torch import Tensor, nn


def _transformers(model: str) -> ModuleType:
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"model {model!r} needs HF transformers, which is not installed; install the "
                         f"'zoo' extra: pip install 'lessmem[zoo]'") from e
    return transformers


# The "tiny" sizes, so that a builder called with a vocabulary alone is small (HF's own defaults
# are 7B-parameter Llama and 124M-parameter GPT-2); config fields given override them.
TINY_LLAMA = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 512, "max_position_embeddings": 1024}
TINY_GPT2 = {"n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 1024, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
             "attn_pdrop": 0.0,
             # GPT2Config's defaults name token 50256 (outside a byte vocabulary); nothing here uses them.
             "bos_token_id": None, "eos_token_id": None}


class CausalLM(nn.Module):
    """An HF ``*ForCausalLM`` returning next-token logits (batch, seq, vocab) instead of a
    ModelOutput, without a key/value cache (training only), so the loss, memory probes and
    sensitivity see a plain tensor."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def tiny_llama(num_classes: int = 256, **config: Any) -> nn.Module:
    """LlamaForCausalLM with vocabulary ``num_classes``; ``config``: LlamaConfig fields over
    ``TINY_LLAMA`` (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, ...)."""
    transformers = _transformers("tiny_llama")
    lm_config = transformers.LlamaConfig(vocab_size=num_classes, **{**TINY_LLAMA, **config})
    return CausalLM(transformers.LlamaForCausalLM(lm_config))


def tiny_gpt2(num_classes: int = 256, **config: Any) -> nn.Module:
    """GPT2LMHeadModel with vocabulary ``num_classes``; ``config``: GPT2Config fields over
    ``TINY_GPT2`` (n_embd, n_layer, n_head, n_positions, resid_pdrop, ...)."""
    transformers = _transformers("tiny_gpt2")
    lm_config = transformers.GPT2Config(vocab_size=num_classes, **{**TINY_GPT2, **config})
    return CausalLM(transformers.GPT2LMHeadModel(lm_config))
