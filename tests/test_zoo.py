"""timm and HF transformers models under ``lessmem.compress(m, {"*": 2})``, in the spirit of timm's
tests/test_models.py: small random-init models built from configs (nothing downloaded), checked for
an exact forward and input gradient, and for saved bytes below stock by a count taken here with
saved_tensors_hooks (independent of ``lessmem.measure_memory``). Skipped without timm /
transformers (the ``zoo`` extra)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import lessmem

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

TOKENS, WIDTH = 64, 64


def hf_gpt2() -> nn.Module:
    return transformers.GPT2Model(transformers.GPT2Config(
        n_embd=WIDTH, n_layer=2, n_head=4, n_positions=TOKENS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def hf_bert() -> nn.Module:
    return transformers.BertModel(transformers.BertConfig(
        hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=4 * WIDTH,
        max_position_embeddings=TOKENS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def hf_llama() -> nn.Module:
    return transformers.LlamaModel(transformers.LlamaConfig(
        hidden_size=WIDTH, intermediate_size=3 * WIDTH, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=TOKENS))


def hf_vit() -> nn.Module:
    return transformers.ViTModel(transformers.ViTConfig(
        hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=4 * WIDTH,
        image_size=32, patch_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def timm_model(name: str, **kwargs: object) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, num_classes=10, **kwargs)


def image(size: int) -> Callable[[], Tensor]:
    return lambda: torch.randn(2, 3, size, size)


def embeddings() -> Tensor:
    return torch.randn(2, TOKENS, WIDTH)


# name -> (model, input, the largest compressed / stock ratio allowed: the measured one plus ~0.02)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor], float]] = {
    "timm_resnet18": (timm_model("resnet18"), image(64), 0.60),
    "timm_vit_tiny": (timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), image(32), 0.87),
    "timm_convnext_atto": (timm_model("convnext_atto"), image(64), 0.66),
    "timm_mobilenetv3": (timm_model("mobilenetv3_small_050"), image(64), 0.79),
    "hf_gpt2": (hf_gpt2, embeddings, 0.53),
    "hf_bert": (hf_bert, embeddings, 0.85),
    "hf_llama": (hf_llama, embeddings, 0.77),
    "hf_vit": (hf_vit, image(32), 0.86),
}
SLOW_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor], float]] = {
    "timm_resnet50": (timm_model("resnet50"), image(64), 0.68),
    "timm_efficientnet_b0": (timm_model("efficientnet_b0"), image(64), 0.80),
    "timm_swin_tiny": (timm_model("swin_tiny_patch4_window7_224"), image(224), 0.83),
}
ALL_CASES = [*CASES, *(pytest.param(name, marks=pytest.mark.slow) for name in SLOW_CASES)]


def build(name: str) -> tuple[nn.Module, Tensor, float]:
    make_model, make_input, max_ratio = {**CASES, **SLOW_CASES}[name]
    torch.manual_seed(0)
    return make_model().train(), make_input(), max_ratio


def run(model: nn.Module, x: Tensor) -> Tensor:
    """The model's main output: HF text models take (batch, tokens, width) embeddings (a float input
    that can have a gradient), the others images; HF returns a ModelOutput, its first field."""
    out = model(inputs_embeds=x) if x.dim() == 3 else model(x)
    return out if isinstance(out, Tensor) else out[0]


def saved_bytes(model: nn.Module, x: Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward, parameters, buffers and the
    input excluded (whole storages: a coarser count than lessmem's byte ranges)."""
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x]}
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in held and ptr != 0:
            storages[ptr] = t.untyped_storage().nbytes()
            kept.append(t.detach())  # no address is reused while counting
        return t.detach()  # no backward follows: a kept grad_fn would leak the graph

    kept: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(model, x)
    del out
    return sum(storages.values())


def forward_backward(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    x = x.clone().requires_grad_(True)
    torch.manual_seed(1)  # the same stochastic-depth draws (swin) in both runs
    out = run(model, x)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), x.grad


@pytest.mark.parametrize("name", ALL_CASES)
def test_forward_and_input_gradient_are_exact(name: str) -> None:
    """Pooling changes only the weight gradients: output and input gradient are bit-identical."""
    model, x, _ = build(name)
    compressed = lessmem.compress(copy.deepcopy(model), {"*": 2})
    out, gx = forward_backward(model, x)
    c_out, c_gx = forward_backward(compressed, x)
    assert torch.equal(out, c_out)
    assert torch.equal(gx, c_gx)


@pytest.mark.parametrize("name", ALL_CASES)
def test_saves_less_than_stock(name: str) -> None:
    model, x, max_ratio = build(name)
    x.requires_grad_(True)
    stock = saved_bytes(model, x)
    compressed = saved_bytes(lessmem.compress(copy.deepcopy(model), {"*": 2}), x)
    assert compressed / stock <= max_ratio


LLAMA_PROJECTIONS = [
    {"*q_proj": 2, "*k_proj": 2, "*v_proj": 2},  # three readers of one tensor: one pooled copy
    {"*o_proj": 2},  # reads attention's output, which scaled_dot_product_attention keeps anyway
    {"*gate_proj": 2, "*up_proj": 2},
    {"*down_proj": 2},
]


@pytest.mark.parametrize("mapping", LLAMA_PROJECTIONS, ids=lambda m: "+".join(m))
def test_no_compressed_layer_adds_bytes(mapping: dict[str, int]) -> None:
    """Each family of Llama projections, compressed alone, saves less than the exact companions
    alone (map None), o_proj exactly as much: it keeps a reference to the attention output, not a
    pooled copy."""
    model, x, _ = build("hf_llama")
    x.requires_grad_(True)
    stock = saved_bytes(lessmem.compress(copy.deepcopy(model), None), x)
    compressed = saved_bytes(lessmem.compress(copy.deepcopy(model), mapping), x)
    if "*o_proj" in mapping:
        assert compressed == stock
    else:
        assert compressed < stock


def test_gpt2_conv1d_is_swapped_and_restored() -> None:
    model, _, _ = build("hf_gpt2")
    keys = list(model.state_dict())
    lessmem.compress(model, {"*": 2})
    assert {"h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj"} <= set(
        lessmem.compressed_layers(model))
    lessmem.uncompress(model)
    assert type(model.h[0].attn.c_attn) is transformers.pytorch_utils.Conv1D
    assert list(model.state_dict()) == keys


def test_timm_linear_is_swapped_and_restored() -> None:
    model, _, _ = build("timm_vit_tiny")
    linear = model.blocks[0].mlp.fc1
    original = type(linear)
    lessmem.compress(model, {"*": 2})
    assert "blocks.0.mlp.fc1" in lessmem.compressed_layers(model)
    lessmem.uncompress(model)
    assert type(linear) is original


@pytest.mark.parametrize("name, activation", [("hf_bert", "encoder.layer.0.intermediate.intermediate_act_fn"),
                                              ("hf_llama", "layers.0.mlp.act_fn")])
def test_hf_activations_are_stored_only_when_asked(name: str, activation: str) -> None:
    model, x, _ = build(name)
    original = type(model.get_submodule(activation))
    lessmem.compress(model, {"*": 2})
    assert type(model.get_submodule(activation)) is original
    stock = forward_backward(model, x)
    lessmem.compress(model, {"*": 2}, act_storage="bf16")
    assert type(model.get_submodule(activation)) is not original
    out, gx = forward_backward(model, x)
    assert torch.equal(out, stock[0])  # the forward stays exact; the input gradient is approximate
    torch.testing.assert_close(gx, stock[1], rtol=0.05, atol=1e-3)
    lessmem.uncompress(model)
    assert type(model.get_submodule(activation)) is original


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama"])
def test_recomputing_companions_are_exact_and_save_less(name: str) -> None:
    """With no pooling (map None), GPT-2's NewGELU and Llama's gated MLP keep only their inputs and
    recompute in backward: every gradient, parameters included, is bit-identical to stock."""
    model, x, _ = build(name)
    companion = lessmem.compress(copy.deepcopy(model), None)
    for m in (model, companion):
        m.zero_grad()
    assert torch.equal(forward_backward(model, x)[1], forward_backward(companion, x)[1])
    for (n, p), q in zip(model.named_parameters(), companion.parameters(), strict=True):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), n
    x.requires_grad_(True)
    assert saved_bytes(companion, x) < saved_bytes(model, x)


def test_checkpointed_model_runs_and_matches() -> None:
    """Under activation checkpointing the saved tensors are packed by torch's hooks: the
    kept-input check must not unpack them in forward (that would recompute, then fail in backward)."""
    model, x, _ = build("hf_llama")
    lessmem.compress(model, {"*": 2})
    plain = forward_backward(model, x)
    x = x.clone().requires_grad_(True)
    torch.manual_seed(1)
    out = torch.utils.checkpoint.checkpoint(run, model, x, use_reentrant=False)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    assert torch.equal(out.detach(), plain[0])
    assert torch.equal(x.grad, plain[1])


LOSSY_8BIT = {"act_storage": "int8", "norm_storage": "int8", "saved_storage": "int8"}
# name -> the largest lossy 8-bit / stock ratio allowed (the measured one plus ~0.02)
LOSSY_CASES = {"hf_gpt2": 0.21, "hf_bert": 0.40, "hf_llama": 0.32, "hf_vit": 0.40}


def whole_gradient(model: nn.Module, x: Tensor) -> tuple[Tensor, Tensor]:
    """(output, the input gradient and every parameter gradient concatenated)."""
    model.zero_grad(set_to_none=True)
    out, gx = forward_backward(model, x)
    return out, torch.cat([gx.flatten(), *(p.grad.flatten() for p in model.parameters() if p.grad is not None)])


@pytest.mark.parametrize("name", LOSSY_CASES)
def test_lossy_8bit_mode_on_hf_models(name: str) -> None:
    """``{"*": 2}`` with every lossy storage at int8: the forward stays exact, the saved bytes drop
    well below exact mode's, and the whole gradient keeps a cosine >= 0.99 to exact mode's
    (measured >= 0.9998: the 8-bit storage barely turns it)."""
    model, x, _ = build(name)
    exact = lessmem.compress(copy.deepcopy(model), {"*": 2})
    lossy = lessmem.compress(copy.deepcopy(model), {"*": 2}, **LOSSY_8BIT)
    exact_out, exact_grad = whole_gradient(exact, x)
    lossy_out, lossy_grad = whole_gradient(lossy, x)
    assert torch.equal(lossy_out, exact_out)
    assert torch.nn.functional.cosine_similarity(lossy_grad, exact_grad, dim=0) >= 0.99
    x.requires_grad_(True)
    assert saved_bytes(lossy, x) / saved_bytes(model, x) <= LOSSY_CASES[name]
