"""Transformers with compressed activations: exact input gradients against stock autograd, the
pooled weight-gradient definition computed independently, k=1 bit-identity, saved bytes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.vision_transformer import EncoderBlock

import lessmem
from lessmem.core import compressed_layers, compressible_layers
from lessmem.core.ops.attention import CompressedMultiheadAttention
from lessmem.core.ops.dropout import PackedDropout
from lessmem.models.vit import vit_tiny_cifar

# Small sizes: tokens not divisible by 2 or 4, so the partial last group is exercised.
B, T, E, HEADS, MLP = 3, 7, 16, 4, 32


def token_means_reference(x: torch.Tensor, k: int) -> torch.Tensor:
    """Each token replaced by the mean of its group of k (last group: its true size). Loops,
    independent of the library's pooling code."""
    out = torch.empty_like(x)
    for i in range(0, x.shape[-2], k):
        out[..., i : i + k, :] = x[..., i : i + k, :].mean(dim=-2, keepdim=True)
    return out


def grads_of(model: nn.Module, x: torch.Tensor, seed: int = 0):
    """Output, input gradient and every parameter gradient, under a fixed RNG state."""
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = model(x)
    y = y[0] if isinstance(y, tuple) else y
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return y.detach(), x.grad.clone(), grads


def small_vit(**kwargs) -> nn.Module:
    # vit_tiny_cifar's architecture, shrunk so each test runs in well under a second.
    config = dict(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32)
    return vit_tiny_cifar(**{**config, **kwargs})


def test_compressible_layers_list_attention():
    names = list(compressible_layers(small_vit()))
    assert "encoder.layers.encoder_layer_0.self_attention" in names
    assert "encoder.layers.encoder_layer_0.mlp.0" in names
    assert not any(n.endswith("out_proj") for n in names)  # handled by its attention module


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("storage", ["native", "bf16"])
def test_encoder_block_input_gradient_exact(k, storage):
    torch.manual_seed(0)
    stock = EncoderBlock(HEADS, E, MLP, dropout=0.0, attention_dropout=0.0).double()
    model = lessmem.compress(copy.deepcopy(stock), {"*": {"kernel": k, "storage": storage}})
    assert isinstance(model.self_attention, CompressedMultiheadAttention)
    x = torch.randn(B, T, E, dtype=torch.float64)
    y0, gx0, g0 = grads_of(stock, x)
    y1, gx1, g1 = grads_of(model, x)
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-12)  # forward exact
    torch.testing.assert_close(gx1, gx0, rtol=0, atol=1e-12)  # error propagation exact
    # Gradients that never touch a pooled input stay exact: biases, LayerNorms, out-projection.
    for name in ("ln_1.weight", "ln_2.bias", "self_attention.in_proj_bias", "mlp.3.bias",
                 "self_attention.out_proj.weight"):
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=1e-12)
    assert not torch.allclose(g1["mlp.0.weight"], g0["mlp.0.weight"])  # pooled: approximate


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("pool_out_proj", [False, True])
def test_attention_weight_gradients_match_definition(batch_first, pool_out_proj):
    torch.manual_seed(0)
    k = 2
    mha = nn.MultiheadAttention(E, HEADS, batch_first=batch_first).double()
    model = lessmem.compress(copy.deepcopy(mha), {"*": k})
    model.pool_out_proj = pool_out_proj
    x = torch.randn(B, T, E, dtype=torch.float64)
    x_in = x if batch_first else x.transpose(0, 1)
    y, _ = model(x_in, x_in, x_in, need_weights=False)
    g = torch.randn_like(y)
    y.backward(g)

    # Reference: attention written out (explicit softmax), gradients of the projections' outputs.
    w, b = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    qkv = (x @ w.t() + b).requires_grad_(True)
    q, k_, v = (t.view(B, T, HEADS, -1).transpose(1, 2) for t in qkv.split(E, dim=-1))
    attn = torch.softmax(q @ k_.transpose(-1, -2) / math.sqrt(E // HEADS), dim=-1)
    ctx_full = (attn @ v).transpose(1, 2).reshape(B, T, E)
    ctx = ctx_full.detach().requires_grad_(True)  # the out-projection's input
    y_ref = ctx @ mha.out_proj.weight.detach().t() + mha.out_proj.bias.detach()
    g_bt = g if batch_first else g.transpose(0, 1)
    torch.testing.assert_close(y if batch_first else y.transpose(0, 1), y_ref, rtol=0, atol=1e-12)
    y_ref.backward(g_bt)
    ctx_full.backward(ctx.grad)  # qkv.grad: gradient of the in-projection's output

    # The paper's weight gradient: output gradient times token-group means of the input.
    expected_in = qkv.grad.reshape(-1, 3 * E).t() @ token_means_reference(x, k).reshape(-1, E)
    torch.testing.assert_close(model.in_proj_weight.grad, expected_in, rtol=0, atol=1e-10)
    ctx_used = token_means_reference(ctx.detach(), k) if pool_out_proj else ctx.detach()
    expected_out = g_bt.reshape(-1, E).t() @ ctx_used.reshape(-1, E)
    torch.testing.assert_close(model.out_proj.weight.grad, expected_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(model.in_proj_bias.grad, qkv.grad.sum((0, 1)), rtol=0, atol=1e-10)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_pooled_linear_weight_gradient_matches_definition(k):
    torch.manual_seed(0)
    lin = nn.Linear(E, 5).double()
    model = lessmem.compress(copy.deepcopy(lin), {"*": k})
    x = torch.randn(2, B, T, E, dtype=torch.float64)  # extra leading dim: (..., tokens, features)
    y, gx, grads = grads_of(model, x)
    g = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    expected = g.reshape(-1, 5).t() @ token_means_reference(x, k).reshape(-1, E)
    torch.testing.assert_close(grads["weight"], expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(gx, g @ lin.weight.detach(), rtol=0, atol=1e-12)


def test_small_vit_input_gradient_exact():
    torch.manual_seed(0)
    stock = small_vit().double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    y0, gx0, _ = grads_of(stock, x)
    for k in (2, 4):
        model = lessmem.compress(copy.deepcopy(stock), {"encoder.layers.*": k})
        y1, gx1, _ = grads_of(model, x)
        torch.testing.assert_close(y1, y0, rtol=0, atol=1e-12)
        torch.testing.assert_close(gx1, gx0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("block", ["encoder_block", "vit"])
def test_k1_bit_identical(block):
    torch.manual_seed(0)
    if block == "vit":  # dropout > 0: PackedDropout must reproduce stock's draws and arithmetic
        stock, x = small_vit(dropout=0.1), torch.randn(2, 3, 16, 16)
    else:
        stock, x = EncoderBlock(HEADS, E, MLP, dropout=0.2, attention_dropout=0.0), torch.randn(B, T, E)
    stock.train()
    model = lessmem.compress(copy.deepcopy(stock), {"*": 1})
    assert any(isinstance(m, PackedDropout) for m in model.modules())
    y0, gx0, g0 = grads_of(stock, x)
    y1, gx1, g1 = grads_of(model, x)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_packed_dropout_keeps_bits_and_matches_stock():
    x = torch.randn(4, 9, 33, requires_grad=True)
    stock = nn.Dropout(0.3)
    packed = lessmem.compress(copy.deepcopy(stock), None)
    assert isinstance(packed, PackedDropout)
    torch.manual_seed(1)
    y0 = stock(x)
    torch.manual_seed(1)
    report = lessmem.measure_memory(packed, x)
    torch.manual_seed(1)
    y1 = packed(x)
    assert torch.equal(y0, y1)
    assert report.total_bytes == math.ceil(x.numel() / 8)  # 1 bit per element
    (g0,) = torch.autograd.grad(y0, x, torch.ones_like(y0))
    (g1,) = torch.autograd.grad(y1, x, torch.ones_like(y1))
    assert torch.equal(g0, g1)


@pytest.mark.parametrize("model_fn", ["encoder_block", "vit"])
def test_saved_bytes_smaller_than_stock(model_fn):
    torch.manual_seed(0)
    if model_fn == "vit":
        stock, x = small_vit(), torch.randn(4, 3, 16, 16)
    else:
        stock, x = EncoderBlock(HEADS, 32, 64, 0.0, 0.0), torch.randn(4, 16, 32)
    base = lessmem.measure_memory(stock, x).total_bytes
    saved = {k: lessmem.measure_memory(lessmem.compress(copy.deepcopy(stock), {"*": k}), x).total_bytes
             for k in (2, 4)}
    assert saved[4] < saved[2] < base
    bf16 = lessmem.compress(copy.deepcopy(stock), {"*": 4}, act_storage="bf16")
    assert lessmem.measure_memory(bf16, x).total_bytes < saved[4]


def test_attention_keeps_no_attention_matrix():
    torch.manual_seed(0)
    model = lessmem.compress(EncoderBlock(HEADS, E, MLP, 0.0, 0.0), {"*": 2})
    report = lessmem.measure_memory(model, torch.randn(B, 50, E))
    assert not any(t.shape[-2:] == (50, 50) for t in report.tensors)


def test_state_dict_keys_unchanged_and_uncompress_restores():
    torch.manual_seed(0)
    stock = small_vit(dropout=0.1)
    model = lessmem.compress(copy.deepcopy(stock), {"encoder.layers.*": 2}, act_storage="int8")
    assert list(model.state_dict()) == list(stock.state_dict())
    assert "encoder.layers.encoder_layer_0.self_attention" in compressed_layers(model)
    lessmem.uncompress(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in stock.modules()]
    assert compressed_layers(model) == {}
    x = torch.randn(2, 3, 16, 16)
    y0, gx0, g0 = grads_of(stock, x)
    y1, gx1, g1 = grads_of(model, x)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_unsupported_attention_calls_fall_back_to_stock():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
    model = lessmem.compress(copy.deepcopy(mha), {"*": 2})
    x, other = torch.randn(B, T, E), torch.randn(B, T, E)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for args, kwargs in [
        ((x, x, x), {}),  # need_weights=True by default
        ((x, x, x), {"attn_mask": mask, "need_weights": False}),
        ((x, other, other), {"need_weights": False}),  # cross-attention
    ]:
        y0, w0 = mha(*args, **kwargs)
        y1, w1 = model(*args, **kwargs)
        assert torch.equal(y0, y1)
        assert (w0 is None and w1 is None) or torch.equal(w0, w1)


def test_attention_rejects_two_kernel_sizes():
    with pytest.raises(ValueError, match="pools tokens"):
        lessmem.compress(nn.MultiheadAttention(E, HEADS), {"*": [2, 4]})


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU()])
@pytest.mark.parametrize("storage", ["bf16", "int8"])
def test_stored_activation_is_close_and_smaller(act, storage):
    torch.manual_seed(0)
    x = torch.randn(B, T, 64)
    model = lessmem.compress(copy.deepcopy(act), None, act_storage=storage)
    assert type(model).__name__.startswith("Stored")
    y0, gx0, _ = grads_of(act, x)
    y1, gx1, _ = grads_of(model, x)
    assert torch.equal(y0, y1)  # forward exact
    tol = 0.02 if storage == "bf16" else 0.05
    assert (gx1 - gx0).abs().max() < tol and not torch.equal(gx0, gx1)  # approximate backward
    # each fed a computed tensor: the caller's batch itself is never counted
    stock_bytes = lessmem.measure_memory(nn.Sequential(nn.Linear(64, 64), act), x).total_bytes
    assert 0 < lessmem.measure_memory(nn.Sequential(nn.Linear(64, 64), model), x).total_bytes < stock_bytes


def test_act_storage_pattern_must_match():
    with pytest.raises(ValueError, match="act_storage pattern"):
        lessmem.compress(small_vit(), None, act_storage={"nothing.*": "bf16"})


def test_no_grad_uses_stock_path():
    model = lessmem.compress(small_vit(), {"*": 2})
    with torch.no_grad():
        y = model(torch.randn(2, 3, 16, 16))
    assert y.shape == (2, 10)
    assert F.softmax(y, -1).sum(-1).allclose(torch.ones(2))
