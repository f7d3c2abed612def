"""Saved bytes of timm and HF transformers models, stock against ``lessmem.compress(m, {"*": 2})``
(exact mode: no lossy storage), beside the figures issue 20 measured before lessmem swapped their
layers, and against the same map in lossy 8-bit mode (``act_storage``, ``norm_storage`` and
``saved_storage`` all ``"int8"``). One forward on the CPU in fp32, randomly initialised models
built from configs (nothing is downloaded); the count is ``lessmem.measure_memory`` (what autograd
keeps for backward, parameters and the input batch excluded). Each compressed row also gives the
cosine of its whole parameter gradient (all gradients concatenated) to stock's, from one forward
and backward on the same input and weights (loss: the output against a fixed random direction;
the same RNG state, so dropout draws match), and the lossy row's to the exact row's (what the
8-bit storage alone changes). Needs the ``zoo`` extra (timm, transformers).

    python benchmarks/zoo.py --out docs/results/zoo.md
    python benchmarks/zoo.py --models resnet50 hf_llama --batch 1
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
import transformers
from torch import nn

import lessmem
from lessmem.core.memory import output_tensor

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
# The lossy 8-bit row: every lossy storage option at int8, beside the same pooling map.
LOSSY_8BIT = {"act_storage": "int8", "norm_storage": "int8", "saved_storage": "int8"}
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


@dataclass
class Row:
    model: str
    stock_mib: float
    exact_ratio: float
    exact_cosine: float
    lossy_ratio: float
    lossy_cosine: float
    lossy_vs_exact: float  # what the 8-bit storage alone changes


def whole_gradient(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every parameter gradient of one forward and backward, concatenated (zeros where a
    parameter gets none)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout / stochastic-depth draws in every model
    out = output_tensor(model(x)).float()
    direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * direction).sum().backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def measure_row(name: str, batch: int, tokens: int, lossy_map: str = "2") -> Row:
    torch.manual_seed(0)
    model, x = build(name, batch, tokens)
    stock = lessmem.measure_memory(model, x)
    stock_grad = whole_gradient(model, x)
    ratios, grads = [], []
    for mapping, options in (({"*": 2}, {}), ({"*": lossy_map}, LOSSY_8BIT)):
        compressed = lessmem.compress(copy.deepcopy(model), mapping, **options)
        ratios.append(lessmem.measure_memory(compressed, x).ratio_to(stock))
        grads.append(whole_gradient(compressed, x))
    return Row(name, stock.total_bytes / 2**20, ratios[0], cosine(grads[0], stock_grad), ratios[1],
               cosine(grads[1], stock_grad), cosine(grads[1], grads[0]))


def table(rows: list[Row], header: str) -> str:
    def cell(v: float | None, fmt: Callable[[float], str]) -> str:
        return "—" if v is None else fmt(v)

    lines = [header, "",
             "| model | stock MiB | {\"*\": 2} ratio | issue 20 (before) | target | cosine | lossy 8-bit ratio | "
             "lossy cosine | lossy vs {\"*\": 2} cosine |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        before, target = ISSUE_RATIOS.get(r.model), TARGETS.get(r.model)
        lines.append(f"| {r.model} | {r.stock_mib:.1f} | {r.exact_ratio:.3f} | {cell(before, '{:.3f}'.format)} | "
                     f"{cell(target, '<= {:.2f}'.format)} | {r.exact_cosine:.4f} | {r.lossy_ratio:.3f} | "
                     f"{r.lossy_cosine:.4f} | {r.lossy_vs_exact:.6f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=[*TIMM_MODELS, "hf_vit", "hf_bert", "hf_gpt2", "hf_llama"])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256, help="sequence length of the HF text models")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--lossy-map", default="2",
                        help="the lossy row's map value for every layer: 2 (pooled, as the exact row) or e.g. "
                             "int8 (no pooling, 8-bit linear / conv inputs)")
    args = parser.parse_args()
    rows = []
    for name in args.models:
        rows.append(measure_row(name, args.batch, args.tokens, args.lossy_map))
        r = rows[-1]
        print(f"{name}: exact {r.exact_ratio:.3f} (cosine {r.exact_cosine:.4f}), lossy 8-bit {r.lossy_ratio:.3f} "
              f"(cosine {r.lossy_cosine:.4f}, {r.lossy_vs_exact:.6f} to exact)", flush=True)
    lossy = ("the same map" if args.lossy_map == "2" else f"`{{\"*\": \"{args.lossy_map}\"}}` (no pooling)")
    header = (f"Saved bytes, stock vs `lessmem.compress(m, {{\"*\": 2}})` (exact mode) and {lossy} with "
              f"`act_storage`, `norm_storage`, `saved_storage` all `\"int8\"` (lossy 8-bit), CPU fp32, batch "
              f"{args.batch}, images 224 px, text {args.tokens} tokens; cosine: whole parameter gradient vs "
              f"stock's (last column: lossy vs exact); timm {timm.__version__}, transformers {transformers.__version__}, torch {torch.__version__}.")
    text = table(rows, header)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
