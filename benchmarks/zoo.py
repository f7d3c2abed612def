"""Saved bytes of timm and HF transformers models, stock against ``lessmem.compress(m, {"*": 2})``
(exact mode: no lossy storage), beside the figures issue 20 measured before lessmem swapped their
layers. One forward on the CPU in fp32, randomly initialised models built from configs (nothing is
downloaded); the count is ``lessmem.measure_memory`` (what autograd keeps for backward, parameters
and the input batch excluded). Needs the ``zoo`` extra (timm, transformers).

    python benchmarks/zoo.py --out docs/results/zoo.md
    python benchmarks/zoo.py --models resnet50 hf_llama --batch 1
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from pathlib import Path

import timm
import torch
import transformers
from torch import nn

import lessmem

# compressed / stock saved bytes that issue 20 measured before the zoo classes were swapped.
ISSUE_RATIOS = {
    "resnet50": 0.650, "densenet121": 0.645, "regnety_008": 0.695, "convnext_tiny": 0.726,
    "mobilenetv3_small_100": 0.736, "efficientnet_b0": 0.775, "swin_tiny_patch4_window7_224": 0.807,
    "vit_tiny_patch16_224": 0.847, "deit_tiny_patch16_224": 0.847, "hf_vit": 0.760, "hf_bert": 0.913,
    "hf_llama": 0.987, "hf_gpt2": 0.992,
}
# The issue's targets for exact mode.
TARGETS = {
    "resnet50": 0.70, "densenet121": 0.70, "regnety_008": 0.70, "convnext_tiny": 0.70,
    "mobilenetv3_small_100": 0.75, "efficientnet_b0": 0.75, "hf_bert": 0.85, "hf_llama": 0.85, "hf_gpt2": 0.85,
}
TIMM_MODELS = [
    "resnet50", "densenet121", "regnety_008", "convnext_tiny", "mobilenetv3_small_100", "efficientnet_b0",
    "swin_tiny_patch4_window7_224", "vit_tiny_patch16_224", "deit_tiny_patch16_224",
]


def hf_text_model(name: str) -> nn.Module:
    """Small (4-layer, 256-wide) random-init HF text models."""
    if name == "hf_bert":
        return transformers.BertModel(transformers.BertConfig(
            vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024, max_position_embeddings=512))
    if name == "hf_gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=1000, n_embd=256, n_layer=4, n_head=4, n_positions=512))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512))


def build(name: str, batch: int, tokens: int) -> tuple[nn.Module, torch.Tensor]:
    """(model in train mode, its input batch)."""
    if name in TIMM_MODELS:
        model = timm.create_model(name, pretrained=False)
        return model.train(), torch.randn(batch, 3, 224, 224)
    if name == "hf_vit":
        model = transformers.ViTForImageClassification(transformers.ViTConfig())  # ViT-B/16
        return model.train(), torch.randn(batch, 3, 224, 224)
    return hf_text_model(name).train(), torch.randint(0, 1000, (batch, tokens))


def ratio_row(name: str, batch: int, tokens: int) -> tuple[str, float, float, float | None, float | None]:
    """(model, stock MiB, ratio, the issue's ratio, the target)."""
    torch.manual_seed(0)
    model, x = build(name, batch, tokens)
    stock = lessmem.measure_memory(model, x)
    compressed = lessmem.measure_memory(lessmem.compress(copy.deepcopy(model), {"*": 2}), x)
    return name, stock.total_bytes / 2**20, compressed.ratio_to(stock), ISSUE_RATIOS.get(name), TARGETS.get(name)


def table(rows: list[tuple[str, float, float, float | None, float | None]], header: str) -> str:
    def cell(v: float | None, fmt: Callable[[float], str]) -> str:
        return "—" if v is None else fmt(v)

    lines = [header, "", "| model | stock MiB | {\"*\": 2} ratio | issue 20 (before) | target |", "|---|---:|---:|---:|---:|"]
    for name, mib, ratio, before, target in rows:
        lines.append(f"| {name} | {mib:.1f} | {ratio:.3f} | {cell(before, '{:.3f}'.format)} | "
                     f"{cell(target, '<= {:.2f}'.format)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*TIMM_MODELS, "hf_vit", "hf_bert", "hf_gpt2", "hf_llama"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="sequence length of the HF text models")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows.append(ratio_row(name, args.batch, args.tokens))
        print(f"{name}: {rows[-1][2]:.3f}", flush=True)
    header = (f"Saved bytes, stock vs `lessmem.compress(m, {{\"*\": 2}})` (exact mode), CPU fp32, batch "
              f"{args.batch}, images 224 px, text {args.tokens} tokens; timm {timm.__version__}, "
              f"transformers {transformers.__version__}, torch {torch.__version__}.")
    text = table(rows, header)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
