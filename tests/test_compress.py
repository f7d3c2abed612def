"""Exactness of lessmem.compress against stock PyTorch autograd, and the weight-gradient
definition of the paper computed independently here."""

from __future__ import annotations

import copy
import fnmatch
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint

import lessmem
from lessmem.core import compressed_layers
from lessmem.core.ops.batchnorm import StoredBatchNormFunction, chunked_batch_norm_backward
from lessmem.core.storage import pack_tensor, tensor_meta
from lessmem.models import MODELS, build_model


def block_means_reference(x: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """Each element replaced by the mean of its k×k block; edge blocks use their true size.
    Written with explicit loops, independent of the library's pooling code."""
    out = torch.empty_like(x)
    h, w = x.shape[-2:]
    for i in range(0, h, kh):
        for j in range(0, w, kw):
            block = x[..., i : i + kh, j : j + kw]
            out[..., i : i + kh, j : j + kw] = block.mean(dim=(-2, -1), keepdim=True)
    return out


def conv_grads(conv: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = conv(x)
    y.backward(grad_out)
    bias = conv.bias.grad.clone() if conv.bias is not None else None
    grads = (y.detach(), x.grad.clone(), conv.weight.grad.clone(), bias)
    conv.zero_grad(set_to_none=True)
    return grads


CONV_CASES = [
    dict(in_channels=4, out_channels=6, kernel_size=3, padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, bias=False),
    dict(in_channels=4, out_channels=6, kernel_size=3, padding="same", dilation=2),
    dict(in_channels=4, out_channels=6, kernel_size=4, padding="same"),  # asymmetric 'same'
    dict(in_channels=4, out_channels=8, kernel_size=3, padding=1, groups=2),
    dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=4),  # depthwise
    dict(in_channels=4, out_channels=6, kernel_size=1),
    dict(in_channels=4, out_channels=6, kernel_size=(3, 5), padding="valid", stride=(1, 2)),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("size", [(8, 8), (7, 7), (9, 6)])
@pytest.mark.parametrize("kernel", [2, 4, (2, 4)])
def test_conv_gradients_match_definition(case, size, kernel):
    torch.manual_seed(0)
    conv = nn.Conv2d(**case)
    x = torch.randn(2, 4, *size)
    with torch.no_grad():
        grad_out = torch.randn_like(conv(x))
    stock_out, stock_gx, stock_gw, stock_gb = conv_grads(conv, x, grad_out)

    ref = copy.deepcopy(conv)
    lessmem.compress(conv, {"": kernel})
    assert "" in compressed_layers(conv)
    out, gx, gw, gb = conv_grads(conv, x, grad_out)

    torch.testing.assert_close(out, stock_out, rtol=0, atol=0)  # forward is exact
    torch.testing.assert_close(gx, stock_gx, rtol=1e-5, atol=1e-5)  # error propagation exact
    if stock_gb is not None:
        torch.testing.assert_close(gb, stock_gb, rtol=1e-5, atol=1e-5)
    # Weight gradient of the paper: stock weight gradient of the block-mean-expanded input.
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    if case.get("padding") == "same" and case["kernel_size"] == 4:
        # asymmetric 'same' pads first (as PyTorch does), so blocks are laid on the padded input
        pad = [1, 2, 1, 2]
        x_pad = block_means_reference(F.pad(x, pad), kh, kw)
        ref.padding = (0, 0)
        expected_gw = conv_grads(ref, x_pad, grad_out)[2]
    else:
        expected_gw = conv_grads(ref, block_means_reference(x, kh, kw), grad_out)[2]
    torch.testing.assert_close(gw, expected_gw, rtol=1e-5, atol=1e-5)


def test_reflect_padding_conv():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect")
    x = torch.randn(2, 3, 7, 7)
    g = torch.randn(2, 5, 7, 7)
    stock = conv_grads(conv, x, g)
    lessmem.compress(conv, {"": 2})
    out = conv_grads(conv, x, g)
    torch.testing.assert_close(out[0], stock[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], stock[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[2], stock[2])


def test_pooling_is_exact_for_blockwise_constant_input():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 4, 4).repeat_interleave(2, -1).repeat_interleave(2, -2)
    g = torch.randn(2, 4, 8, 8)
    stock = conv_grads(conv, x, g)
    lessmem.compress(conv, {"": 2})
    torch.testing.assert_close(conv_grads(conv, x, g)[2], stock[2], rtol=1e-5, atol=1e-5)


# Input side per registered model (the ViT-B/16 patch grid fixes 224); every registry entry is tested,
# the large ImageNet nets under -m slow only (their layer types are covered by the smaller ones).
INPUT_SIZE = {"vit_b_16": 224, "vgg11_bn": 32, "resnet20": 32, "resnet18_cifar": 32, "vit_tiny_cifar": 32}
SLOW_MODELS = {"vit_b_16", "vgg11_bn", "resnet50"}
REGISTRY = [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_MODELS else name for name in sorted(MODELS)]


# Registered language models read token ids: their input gradient is an embedding's gradient (the
# position embedding for GPT-2, whose token embedding is tied to lm_head, a pooled layer).
TOKEN_MODELS = {"tiny_llama": "lm.model.embed_tokens.weight", "tiny_gpt2": "lm.transformer.wpe.weight"}


def model_grads(model: nn.Module, x: torch.Tensor):
    torch.manual_seed(1)  # same dropout masks in every call
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    out = model(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("name", REGISTRY)
def test_k1_is_bit_identical_and_input_grads_exact(name):
    torch.manual_seed(0)
    model = build_model(name, num_classes=10)
    for p in model.parameters():  # torchvision's ViT zero-inits its head: every gradient would be 0
        if p.dim() > 1 and not p.any():
            nn.init.normal_(p, std=0.02)
    size = INPUT_SIZE.get(name, 64)
    x = torch.randint(0, 10, (2, 16)) if name in TOKEN_MODELS else torch.randn(2, 3, size, size)
    stock_out, stock_gx, stock_grads = model_grads(model, x)
    if name in TOKEN_MODELS:
        stock_gx = stock_grads[TOKEN_MODELS[name]]

    lessmem.compress(model, {"*": 1})
    out, gx, grads = model_grads(model, x)
    gx = grads[TOKEN_MODELS[name]] if name in TOKEN_MODELS else gx
    assert torch.equal(out, stock_out)
    assert torch.equal(gx, stock_gx)
    for n in stock_grads:
        assert torch.equal(grads[n], stock_grads[n]), n

    lessmem.compress(model, {"*": 2})
    first = next(iter(compressed_layers(model)))
    out, gx, grads = model_grads(model, x)
    gx = grads[TOKEN_MODELS[name]] if name in TOKEN_MODELS else gx
    assert torch.equal(out, stock_out)
    # Error propagation stays exact through the whole network: the input gradient only depends
    # on weights, BatchNorm inputs, ReLU masks and max-pool indices, all kept exactly.
    torch.testing.assert_close(gx, stock_gx, rtol=1e-4, atol=1e-6)
    weight = f"{first}.weight"  # the first compressed layer's weight gradient is approximate
    cos = F.cosine_similarity(grads[weight].flatten(), stock_grads[weight].flatten(), dim=0)
    assert 0.0 < cos < 1.0


def test_uncompress_and_state_dict_round_trip():
    model = torchvision.models.resnet18(num_classes=10)
    stock_types = [type(m) for m in model.modules()]
    keys = list(model.state_dict())
    lessmem.compress(model, {"layer1.*": 4, "*": 2})
    assert list(model.state_dict()) == keys
    specs = compressed_layers(model)
    assert specs["layer1.0.conv1"].kernel == (4, 4)
    assert specs["layer2.0.conv1"].kernel == (2, 2)
    assert "fc" in specs  # Linear on 2-D input falls back to stock, but is addressable
    fresh = torchvision.models.resnet18(num_classes=10)
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(fresh.state_dict())
    lessmem.uncompress(model)
    assert [type(m) for m in model.modules()] == stock_types
    assert not compressed_layers(model)


def test_first_matching_pattern_wins():
    model = torchvision.models.resnet18()
    lessmem.compress(model, {"layer1.0.conv1": 1, "layer1.*": 4, "*": 2})
    specs = compressed_layers(model)
    assert "layer1.0.conv1" not in specs  # k=1: stock module kept
    assert type(model.layer1[0].conv1) is nn.Conv2d
    assert specs["layer1.0.conv2"].kernel == (4, 4)
    assert specs["conv1"].kernel == (2, 2)


@pytest.mark.parametrize(
    "mapping, message",
    [
        ({"layer9.*": 2}, "layer9"),
        ({"*": 0}, "must be >= 1"),
        ({"*": -2}, "must be >= 1"),
        ({"*": 1.5}, "not an integer"),
        ({"*": "2x"}, "cannot read"),
        ({"*": "2/int3"}, "unknown storage"),
        ({"*": True}, "not an integer"),
        ({"*": [2, 2, 2]}, "must be k or"),
        ({"*": {"kernel": 2, "storage": "fp4"}}, "unknown storage"),
        ({"*": {"size": 2}}, "needs 'kernel'"),
    ],
)
def test_bad_mappings_raise_clear_errors(mapping, message):
    model = torchvision.models.resnet18()
    with pytest.raises(ValueError, match=message) as info:
        lessmem.compress(model, mapping)
    if "layer9" in message:
        assert "layer1.0.conv1" in str(info.value)  # lists the available layers


def test_no_grad_and_eval_save_nothing_and_match_stock():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    lessmem.compress(model, {"*": 4})
    with torch.no_grad():
        assert torch.equal(model(x), expected)
        report = lessmem.measure_memory(model, x)
    assert report.total_bytes == 0


def test_gradient_checkpointing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    lessmem.compress(model, {"*": 2})
    x = torch.randn(2, 3, 12, 12, requires_grad=True)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    checkpoint(model, x, use_reentrant=False).sum().backward()
    ckpt = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    for a, b in zip(plain, ckpt, strict=True):
        torch.testing.assert_close(a, b)


def test_cpu_bf16_autocast():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stock_out, stock_gx, stock_grads = model_grads(model, x)
    lessmem.compress(model, {"*": 2})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, gx, grads = model_grads(model, x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, stock_out, rtol=0, atol=0)
    torch.testing.assert_close(gx, stock_gx, rtol=0.05, atol=1e-3)
    assert all(g.dtype == torch.float32 for g in grads.values())


def test_packed_relu_and_compact_maxpool_are_exact():
    torch.manual_seed(0)
    for layer in (nn.ReLU(), nn.ReLU6(), nn.Hardtanh(-0.5, 0.5), nn.MaxPool2d(3, 2, 1),
                  nn.MaxPool2d(2), nn.MaxPool2d(3, 2, 1, dilation=2, ceil_mode=True)):
        x = torch.randn(3, 4, 11, 13)
        x[0, 0, 0, :4] = 0.0  # ties at the kink
        stock_x = x.clone().requires_grad_(True)
        y = layer(stock_x)
        g = torch.randn_like(y)
        y.backward(g)
        model = nn.Sequential(copy.deepcopy(layer))
        lessmem.compress(model, None)
        assert type(model[0]) is not type(layer)
        cx = x.clone().requires_grad_(True)
        out = model(cx)
        out.backward(g)
        assert torch.equal(out, y.detach())
        assert torch.equal(cx.grad, stock_x.grad), layer


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernel", "torch-reference"])
def test_compact_maxpool_matches_stock_on_hard_inputs(fused, monkeypatch):
    """Max-pooling with uint8 window positions against stock, values and gradients bit for bit:
    ties (integer inputs: the first maximum wins), NaN (it wins), all -inf windows, padding,
    dilation, ceil_mode, strides 1-3, rows wide enough for the vectorized path, channels-last,
    float64 and bfloat16. ``fused`` off forces the torch reference."""
    from lessmem.core.ops.maxpool import CompactMaxPool2dFunction

    if not fused:
        monkeypatch.setenv("LESSMEM_CPU_KERNELS", "0")
    torch.manual_seed(0)
    geometries = [((3, 3), (2, 2), (1, 1), (1, 1), False), ((2, 2), (2, 2), (0, 0), (1, 1), False),
                  ((3, 3), (1, 1), (1, 1), (1, 1), False), ((3, 2), (3, 2), (1, 0), (1, 1), True),
                  ((3, 3), (2, 2), (1, 1), (2, 2), True), ((1, 1), (1, 1), (0, 0), (1, 1), False),
                  ((5, 5), (2, 3), (2, 2), (1, 1), True)]
    for (kernel, stride, padding, dilation, ceil), dtype, cl in itertools.product(
            geometries, (torch.float32, torch.float64, torch.bfloat16), (False, True)):
        x = torch.randint(-3, 4, (2, 3, 19, 37)).to(dtype)
        x[0, 0, 2, 5], x[0, 1, :3, :3], x[1, 2, 4, 10:14] = float("nan"), float("-inf"), float("nan")
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        args = (kernel, stride, padding, dilation, ceil)
        sx, cx = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        y = F.max_pool2d(sx, *args)
        out = CompactMaxPool2dFunction.apply(cx, *args)
        g = torch.randn_like(y)
        y.backward(g)
        out.backward(g)
        assert torch.equal(out.nan_to_num(7.0), y.detach().nan_to_num(7.0)), (args, dtype, cl)
        if dtype == torch.bfloat16:  # overlapping windows: bf16 sums in another order than stock
            torch.testing.assert_close(cx.grad, sx.grad, rtol=0.02, atol=0.05)
        else:
            assert torch.equal(cx.grad, sx.grad), (args, dtype, cl)
    # arguments stock rejects are rejected with stock's message, kernel or not
    with pytest.raises(RuntimeError, match="pad should be"):
        CompactMaxPool2dFunction.apply(torch.randn(1, 2, 8, 8), (3, 3), (2, 2), (2, 2), (1, 1), False)
    with pytest.raises(RuntimeError, match="too small"):
        CompactMaxPool2dFunction.apply(torch.randn(1, 2, 8, 8), (9, 9), (1, 1), (0, 0), (1, 1), False)


def test_inplace_relu_after_conv():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 3))
    x = torch.randn(2, 3, 10, 10, requires_grad=True)
    model(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    lessmem.compress(model, {"*": 2})
    model(x).sum().backward()
    torch.testing.assert_close(x.grad, expected)


def test_linear_token_pooling():
    torch.manual_seed(0)
    layer = nn.Linear(6, 5)
    x = torch.randn(2, 7, 6)
    g = torch.randn(2, 7, 5)
    xs = x.clone().requires_grad_(True)
    layer(xs).backward(g)
    stock_gx, stock_gb = xs.grad.clone(), layer.bias.grad.clone()
    ref_in = torch.empty_like(x)
    for i in range(0, 7, 2):
        ref_in[:, i : i + 2] = x[:, i : i + 2].mean(1, keepdim=True)
    expected_gw = (g.reshape(-1, 5).t() @ ref_in.reshape(-1, 6))
    layer.zero_grad()
    lessmem.compress(layer, {"": 2})
    xc = x.clone().requires_grad_(True)
    layer(xc).backward(g)
    torch.testing.assert_close(xc.grad, stock_gx)
    torch.testing.assert_close(layer.bias.grad, stock_gb)
    torch.testing.assert_close(layer.weight.grad, expected_gw)


# ------------------------------------------------------------------------------------------
# Memory: what is kept, computed from saved-tensor bytes
# ------------------------------------------------------------------------------------------


class Doubled(nn.Module):
    """Feeds ``layer`` a computed tensor: the caller's batch itself is never counted."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x * 2)


def test_saved_bytes_of_single_layers():
    x = torch.randn(2, 8, 9, 9, requires_grad=True)
    conv = Doubled(nn.Conv2d(8, 8, 3, padding=1))
    stock = lessmem.measure_memory(conv, x).total_bytes
    assert stock == x.numel() * 4  # stock keeps the full input (the weight is a parameter)
    for k in (2, 4):
        lessmem.compress(conv, {"layer": k})
        pooled = 2 * 8 * math.ceil(9 / k) ** 2 * 4
        assert lessmem.measure_memory(conv, x).total_bytes == pooled
    relu = nn.Sequential(nn.ReLU())
    lessmem.compress(relu, None)
    assert lessmem.measure_memory(relu, x).total_bytes == math.ceil(x.numel() / 8)
    pool = nn.Sequential(nn.MaxPool2d(3, 2))
    lessmem.compress(pool, None)
    assert lessmem.measure_memory(pool, x).total_bytes == 2 * 8 * 4 * 4  # one uint8 per output


def test_shared_input_is_pooled_once():
    class TwoReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(4, 4, 3, padding=1)
            self.b = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.a(x) + self.b(x)

    model = lessmem.compress(TwoReaders(), {"*": 2})
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    assert lessmem.measure_memory(model, x).total_bytes == 2 * 4 * 4 * 4 * 4


def test_pooled_copies_are_shared_by_views_of_one_memory_laid_out_alike():
    """The pooled-copy cache lives on a view's base under the view's geometry: another view of the same
    memory and layout finds the copy, a view laid out otherwise or a changed tensor does not."""
    from lessmem.core.ops.pooling import pooled_tokens_once

    base = torch.randn(2, 4, 3, 8)
    first = pooled_tokens_once(base.view(2, 4, 24), 1, "int8")
    assert pooled_tokens_once(base.view(2, 4, 24), 1, "int8") is first  # another view object, same layout
    assert pooled_tokens_once(base.reshape(2, 4, 24), 2, "int8") is not first  # another kind
    assert pooled_tokens_once(base.view(8, 24), 1, "int8") is not first  # another shape
    assert pooled_tokens_once(base.transpose(1, 2).reshape(2, 3, 32), 1, "int8")[1].shape == (2, 3, 32)
    base.add_(1)  # a new version: every copy of the old values is dropped
    again = pooled_tokens_once(base.view(2, 4, 24), 1, "int8")
    assert again is not first and not torch.equal(again[0][1], first[0][1])


def test_resnet18_saves_what_the_issue_targets():
    model = torchvision.models.resnet18()
    x = torch.randn(2, 3, 224, 224)
    stock = lessmem.measure_memory(model, x)
    ratios = {}
    for k in (1, 2, 4):
        lessmem.compress(model, {"*": k})
        ratios[k] = lessmem.measure_memory(model, x).ratio_to(stock)
    assert ratios[1] < 0.85  # exact companions alone: ReLU bits, uint8 max-pool indices
    assert ratios[2] <= 0.62
    assert ratios[4] <= 0.56
    # The trap: pooling conv inputs while ReLU/MaxPool keep full tensors saves ~nothing.
    lessmem.compress(model, {"*": 2}, exact_companions=False)
    assert lessmem.measure_memory(model, x).ratio_to(stock) > 0.95


def test_norm_storage_is_smaller_and_approximate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    x = torch.randn(4, 3, 12, 12)
    _, stock_gx, _ = model_grads(model, x)
    assert stock_gx is not None
    sizes = {}
    for storage in ("native", "bf16", "int8"):
        lessmem.compress(model, {"*": 2}, norm_storage=storage)
        sizes[storage] = lessmem.measure_memory(model, x).total_bytes
        _, gx, _ = model_grads(model, x)
        torch.testing.assert_close(gx, stock_gx, rtol=0.1, atol=0.05)
        assert torch.equal(gx, stock_gx) == (storage == "native")
    assert sizes["int8"] < sizes["bf16"] < sizes["native"]
    with pytest.raises(ValueError, match="unknown storage"):
        lessmem.compress(model, {"*": 2}, norm_storage="fp8")


@pytest.mark.parametrize("channels_last", [False, True])
def test_integer_norm_storage_codes_every_channel_alike(channels_last: bool) -> None:
    """BatchNorm's integer codes keep the normalized input: channels whose scales span three
    decades get input gradients of the same small relative error in either layout. Coding x
    itself, a channels-last code group spans channels and the small channels' gradients are noise."""
    torch.manual_seed(0)
    scales = torch.logspace(-3, 0, 16).view(1, -1, 1, 1)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = ((torch.randn(8, 16, 8, 16) + 5) * scales).contiguous(memory_format=layout)
    w, b = torch.ones(16), torch.zeros(16)
    stock_in = x.clone().requires_grad_()
    out = F.batch_norm(stock_in, None, None, w, b, True, 0.1, 1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)

    def channel_error(gx: torch.Tensor) -> torch.Tensor:
        return ((gx - stock_in.grad).square().sum((0, 2, 3)) / stock_in.grad.square().sum((0, 2, 3))).sqrt()

    leaf = x.clone().requires_grad_()
    StoredBatchNormFunction.apply(leaf, w, b, torch.zeros(16), torch.ones(16), 0.1, 1e-5, "int4").backward(grad)
    assert channel_error(leaf.grad).max() < 0.05
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    raw, *_ = chunked_batch_norm_backward(grad.clone(), pack_tensor(x, "int4"), "int4", tensor_meta(x), w,
                                          mean, invstd, [True] * 3, False)
    # the same bits spent on x: fine where a group stays in one channel plane, noise across channels
    assert (channel_error(raw).max() > 1) == channels_last


@pytest.mark.parametrize("swapped", [False, True], ids=["matrix-product", "swapped-conv"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("size", [8, 12, 9])
def test_block_grid_weight_grad_equals_expanded_input(size, channels_last, swapped, monkeypatch):
    """The weight gradient taken on the pooled grid (no expanded copy) equals the one on the
    expanded block means, for strides that divide k, paddings, dilations and groups, by either
    way of forming the products (``swapped``); other geometries (odd sizes, stride 3) take the
    expanding path and must agree too."""
    from lessmem.core.ops import conv, conv_weight_grad, pooling
    from lessmem.core.ops.conv import conv_grads, pooled_conv_grads
    from lessmem.core.ops.pooling import expand_blocks, pool_blocks

    monkeypatch.setattr(conv, "block_path_pays", lambda *args: True)  # whatever the cost model says
    monkeypatch.setattr(conv_weight_grad, "SWAPPED_CONV_MIN_BLOCKS_PER_CHANNEL", 0 if swapped else 10**9)
    monkeypatch.setattr(pooling, "PAD_COPY_MAX_ELEMENTS", 0 if swapped else 2**30)  # both padding routes too
    torch.manual_seed(0)
    for k, s, kk, pad, d, g in [(2, 1, 3, 1, 1, 1), (2, 2, 3, 1, 1, 1), (4, 1, 3, 1, 1, 2),
                                (4, 2, 1, 0, 1, 1), (2, 1, 5, 2, 2, 1), (2, 2, 2, 0, 1, 4),
                                (4, 4, 3, 0, 1, 1), (2, 3, 3, 1, 1, 1), (1, 1, 3, 1, 1, 1)]:
        x = torch.randn(2, 4, size, size, dtype=torch.float64)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(8, 4 // g, kk, kk, dtype=torch.float64)
        go = torch.randn_like(F.conv2d(x, w, None, s, pad, d, g))
        pooled = pool_blocks(x, (k, k))
        geometry = ((s, s), (pad, pad), (d, d), g)
        ref = conv_grads(go, expand_blocks(pooled, (k, k), (size, size)), w, True, *geometry,
                         (True, True, True))
        got = pooled_conv_grads(go, pooled, x.shape, w, True, *geometry, (k, k), (True, True, True))
        for a, b in zip(ref, got, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pad_copy", [True, False], ids=["padded-copy", "edge-sums"])
def test_window_sums_of_zero_padded_input(pad_copy, monkeypatch) -> None:
    """sum_windows with front/back padding equals window sums of the explicitly padded
    tensor, by either route (padded copy for small tensors, edge sums for large ones)."""
    from lessmem.core.ops import pooling

    monkeypatch.setattr(pooling, "PAD_COPY_MAX_ELEMENTS", 2**30 if pad_copy else 0)
    torch.manual_seed(0)
    for cl, m, front, back, dim, size in itertools.product(
            (False, True), (1, 2, 3, 4), (0, 1, 2, 5), (0, 1, 3), (2, 3), (1, 2, 7)):
        x = torch.randn(2, 3, size, size + 1, dtype=torch.float64)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        padded = F.pad(x, (front, back, 0, 0) if dim == 3 else (0, 0, front, back))
        count = padded.shape[dim] - m + 1
        if count <= 0:
            continue
        expected = sum(padded.narrow(dim, j, count) for j in range(m))
        got = pooling.sum_windows(x, m, dim, front, back)
        assert got.shape == expected.shape, (cl, m, front, back, dim, size)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_depthwise_weight_grad_kernel_equals_expanded_input() -> None:
    """The C++ depthwise weight gradient (block means expanded per channel in cache) equals the
    weight gradient on the expanded means, for strides 1-2, paddings, dilations, 1x1 to 5x5 taps,
    2x2 and 4x4 blocks, fp64 and fp32; pooled_conv_grads routes depthwise layers to it."""
    from lessmem.core.kernels import cpu as cpu_kernels
    from lessmem.core.ops.conv import conv_grads, depthwise_kernel_takes, pooled_conv_grads
    from lessmem.core.ops.pooling import expand_blocks, pool_blocks

    if not cpu_kernels.enabled_for(torch.zeros(1)):
        pytest.skip("no C++ compiler here: depthwise layers expand the means")
    torch.manual_seed(0)
    calls = []
    kernel_fn = cpu_kernels.depthwise_weight_grad
    for k, s, kk, pad, d in [(2, 1, 3, 1, 1), (2, 2, 3, 1, 1), (4, 1, 5, 2, 1), (2, 1, 3, 2, 2),
                             (4, 2, 3, 0, 1), (2, 1, 1, 0, 1), (2, 2, 5, 2, 2)]:
        for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
            x = torch.randn(3, 6, 36, 40, dtype=dtype)
            w = torch.randn(6, 1, kk, kk, dtype=dtype)
            geometry = ((s, s), (pad, pad), (d, d), 6)
            go = torch.randn_like(F.conv2d(x, w, None, *geometry))
            pooled = pool_blocks(x, (k, k))
            ref = conv_grads(go, expand_blocks(pooled, (k, k), x.shape[2:]), w, True, *geometry, (True, True, True))
            with pytest.MonkeyPatch.context() as m:
                m.setattr(cpu_kernels, "depthwise_weight_grad", lambda *a: calls.append(a) or kernel_fn(*a))
                got = pooled_conv_grads(go, pooled, x.shape, w, True, *geometry, (k, k), (True, True, True))
            for a, b in zip(ref, got, strict=True):
                torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    assert len(calls) == 14
    assert not depthwise_kernel_takes(go.contiguous(memory_format=torch.channels_last), pooled, x.shape,
                                      w, 6, (2, 2), (1, 1))


def test_channels_last_model_matches_stock():
    """NHWC models: same outputs, exact input grads, masks packed in memory order."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    stock_out, stock_gx, _ = model_grads(model, x)
    lessmem.compress(model, {"*": 2})
    out, gx, grads = model_grads(model, x)
    assert torch.equal(out, stock_out)
    torch.testing.assert_close(gx, stock_gx, rtol=1e-4, atol=1e-6)
    assert grads["conv1.weight"].is_contiguous(memory_format=torch.channels_last)


def test_linear_readers_share_one_pooled_copy():
    """q / k / v projections read one tensor: they keep one pooled copy of it, not three."""

    class ThreeReaders(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = x * 2
            return self.q(h) + self.k(h) + self.v(h)

    model = lessmem.compress(ThreeReaders(), {"*": 2})
    x = torch.randn(2, 16, 8, requires_grad=True)
    assert lessmem.measure_memory(model, x).total_bytes == 2 * 8 * 8 * 4


class AttentionThenProjection(nn.Module):
    """scaled_dot_product_attention saves its output; the projection reads a reshaped view of it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, q):
        out = F.scaled_dot_product_attention(q, q, q)  # (batch, heads, tokens, 8)
        return self.proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], 16))


def test_linear_keeps_a_reference_to_an_input_saved_anyway():
    """Pooling the projection's input would add a copy of a tensor attention keeps anyway: the
    layer keeps a reference (no added bytes) and its weight gradient stays exact."""
    # (batch, heads, tokens, 8) laid out (batch, tokens, heads, 8), as a projection's output viewed
    # as heads: attention's output then comes in that layout, and the reshape below is a view of it.
    q = torch.randn(2, 32, 2, 8).transpose(1, 2).requires_grad_(True)
    model = AttentionThenProjection()
    stock = lessmem.measure_memory(model, q).total_bytes
    compressed = lessmem.compress(copy.deepcopy(model), {"*": 2})
    assert lessmem.measure_memory(compressed, q).total_bytes == stock
    model(q).sum().backward()
    compressed(q).sum().backward()
    assert torch.equal(model.proj.weight.grad, compressed.proj.weight.grad)


def test_linear_subclasses_are_swapped_only_with_linears_forward():
    class SameForward(nn.Linear):
        pass

    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = lessmem.compress(nn.Sequential(SameForward(4, 4), OwnForward(4, 4)), {"*": 2})
    assert list(lessmem.compressed_layers(model)) == ["0"]
    lessmem.uncompress(model)
    assert [type(m) for m in model] == [SameForward, OwnForward]


class _DroppedBlock(nn.Module):
    """A block with dropout after it: its rerun must draw the same mask."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.drop = inner, nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.inner(x))


def _step_results(model: nn.Module, x: torch.Tensor) -> tuple[dict, dict]:
    torch.manual_seed(1)
    model.zero_grad()
    model(x).square().mean().backward()
    return ({n: p.grad.clone() for n, p in model.named_parameters()},
            {n: b.clone() for n, b in model.named_buffers()})


@pytest.mark.parametrize("plan", [
    lessmem.CompressionPlan(recompute=("layer*.*",)),
    lessmem.CompressionPlan(recompute=("conv1+bn1+relu+maxpool", "layer*.*")),
    lessmem.CompressionPlan({"layer*.conv2": "from_bn"},
                            norm_storage="chunked", recompute=("layer3.*", "layer4")),
], ids=["blocks", "stem_run_and_blocks", "with_from_bn"])
def test_recomputed_regions_are_stock_bit_for_bit(plan: lessmem.CompressionPlan) -> None:
    """Recomputed blocks (dropout inside one: torch's RNG restored) and the stem's run of layers give
    stock's gradients and BatchNorm statistics (updated once, not again by the rerun) and keep fewer
    bytes; uncompress restores the forward."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    model.layer1[0] = _DroppedBlock(model.layer1[0])
    x = torch.randn(4, 3, 32, 32)
    stock, recomputed = copy.deepcopy(model), lessmem.compress(copy.deepcopy(model), plan)
    regions = [n for r in plan.recompute for n in r.split("+")]
    assert set(lessmem.core.recomputed_modules(recomputed)) == {
        n for n in dict(model.named_modules()) if any(fnmatch.fnmatchcase(n, r) for r in regions)
        and not any(n.startswith(f"{o}.") and fnmatch.fnmatchcase(o, r) for o in dict(model.named_modules()) for r in regions)}
    grads, buffers = _step_results(stock, x)
    grads_r, buffers_r = _step_results(recomputed, x)
    tolerance = 0.0 if plan.norm_storage == "native" else 1e-5
    for name, g in grads.items():
        assert torch.allclose(grads_r[name], g, rtol=tolerance, atol=tolerance * g.abs().max().item()), name
    for name, b in buffers.items():
        assert torch.equal(buffers_r[name], b), name
    assert lessmem.measure_memory(recomputed, x).total_bytes < 0.6 * lessmem.measure_memory(stock, x).total_bytes
    lessmem.uncompress(recomputed)
    assert not lessmem.core.recomputed_modules(recomputed)


class _InPlaceInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.mul_(2))


class _OutsideRng(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # state outside torch's RNG: the rerun computes something else
        return self.lin(x) * self.calls


@pytest.mark.parametrize(("module", "message"), [(_InPlaceInput, "modifies its input in place"),
                                                 (_OutsideRng, "different output when rerun")])
def test_recompute_refuses_a_module_that_cannot_rerun(module: type[nn.Module], message: str) -> None:
    model = nn.Sequential(nn.Linear(8, 8), module(), nn.Linear(8, 2))
    lessmem.compress(model, lessmem.CompressionPlan(recompute=("1",)))
    with pytest.raises(RuntimeError, match=rf"module '1' .*{message}"):
        model(torch.randn(4, 8)).sum().backward()


def test_recomputed_run_called_out_of_order_fails_by_name() -> None:
    """A run whose parent does not call its layers one after another on each other's outputs."""
    model = torchvision.models.resnet18(num_classes=10)
    lessmem.compress(model, lessmem.CompressionPlan(recompute=("bn1+conv1",)))
    with pytest.raises(RuntimeError, match=r"recomputed run 'bn1\+conv1': 'conv1' got another tensor than 'bn1' returned"):
        model(torch.randn(2, 3, 32, 32))
    with pytest.raises(ValueError, match="name sibling modules"):
        lessmem.compress(model, lessmem.CompressionPlan(recompute=("conv1+layer1.0.bn1",)))


def test_recompute_patterns_are_checked() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    with pytest.raises(ValueError, match="recompute pattern 'blocks.*' matches no module name"):
        lessmem.compress(model, lessmem.CompressionPlan(recompute=("blocks.*",)))
    with pytest.raises(ValueError, match="the model itself"):
        lessmem.CompressionPlan(recompute=("",))
    plan = lessmem.CompressionPlan({"layer1.*": "from_bn"}, norm_storage="chunked", recompute=("layer2.*",))
    assert plan.lossless and plan.compresses and plan.digest != plan.replace(recompute=()).digest
    assert lessmem.CompressionPlan.from_dict(plan.to_dict()) == plan
    assert not plan.replace(norm_storage="int8").lossless
