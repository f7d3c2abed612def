"""``from_bn``: a conv input rebuilt in backward from the BatchNorm code and ReLU mask before it.

Against a reference conv whose input is mask * (gamma * decoded BatchNorm code + beta), the
weight gradient is the same bits; forward and input gradient are stock's; the conv keeps no
bytes of its own (independent saved-tensor count); misuse fails with a message naming the layer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lessmem.core import compress, measure_memory
from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.ops import rebuilt_input
from lessmem.core.rounding import load_rounding_state, rounding_state
from lessmem.core.spec import parse_spec
from lessmem.core.storage import unpack_tensor
from lessmem.models.registry import build_model


def block(inplace: bool = True, channels: int = 16, stride: int = 2, act: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), act(inplace=inplace),
                        nn.Conv2d(channels, 8, 3, padding=1, stride=stride))
    with torch.no_grad():  # a trained BatchNorm's spread of scales and shifts, some negative; ReLU6 saturating
        net[1].weight.uniform_(-1.5, 1.5) if act is nn.ReLU else net[1].weight.uniform_(-6.0, 6.0)
        net[1].bias.uniform_(-0.5, 0.5)
    return net


def reference_input(model: nn.Sequential, x: torch.Tensor, storage: str) -> torch.Tensor:
    """What from_bn must rebuild: the ReLU's mask times gamma * (the BatchNorm's decoded code) + beta."""
    node = model[1](model[0](x)).grad_fn  # one more forward: same batch, same statistics, fresh codes
    weight, mean, invstd, *packed = node.saved_tensors
    decoded = unpack_tensor(packed, storage, node.meta).float()
    chan = (1, -1, 1, 1)
    x_hat = decoded if node.normalized else (decoded - mean.view(chan)) * invstd.view(chan)
    z = x_hat * weight.view(chan) + model[1].bias.view(chan)
    exact = F.batch_norm(model[0](x), None, None, weight, model[1].bias, True, 0.0, model[1].eps)
    if isinstance(model[2], nn.ReLU6):  # off the pass mask: the bound on z's side
        return torch.where((exact > 0) & (exact < 6), z, torch.where(z > 3, 6.0, 0.0)).detach()
    return ((exact > 0) * z).detach()


@pytest.mark.parametrize("storage", ["int2", "int8", "bf16"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("inplace", [True, False])
# per sample: code groups and mask bytes aligned (2304), mask bytes only (400), neither (63)
@pytest.mark.parametrize(("channels", "height"), [(16, 12), (16, 5), (7, 3)])
@pytest.mark.parametrize("act", [nn.ReLU, nn.ReLU6])
def test_weight_grad_from_the_rebuilt_input(storage: str, channels_last: bool, inplace: bool, channels: int,
                                            height: int, act: type[nn.Module]) -> None:
    stock = block(inplace, channels, act=act)
    x = torch.randn(5, 3, height, height)
    if channels_last:
        x, stock = x.contiguous(memory_format=torch.channels_last), stock.to(memory_format=torch.channels_last)
    model = compress(copy.deepcopy(stock), {"3": "from_bn"}, norm_storage=storage)
    noise = rounding_state()
    kept = {}

    def keep(module, inputs, output) -> None:
        output.retain_grad()
        kept["y"] = output

    model[2].register_forward_hook(keep)
    out = model(x.clone().requires_grad_(True))
    g = torch.randn_like(out)
    out.backward(g)

    load_rounding_state(noise)  # the BatchNorm's codes again: same batch, same noise
    conv = copy.deepcopy(stock[3])
    conv.load_state_dict(model[3].state_dict())
    conv(reference_input(model, x, storage)).backward(g)
    assert torch.equal(model[3].weight.grad, conv.weight.grad)
    assert torch.allclose(model[3].bias.grad, conv.bias.grad, rtol=1e-5, atol=1e-5)

    y = stock[2](stock[1](stock[0](x))).detach().requires_grad_(True)
    stock_out = stock[3](y)
    stock_out.backward(g)
    assert torch.equal(out, stock_out)  # forward is stock's
    assert torch.equal(kept["y"].grad, y.grad)  # and so is the input gradient


@pytest.mark.parametrize("storage", ["int2", "int8"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(("channels", "height"), [(16, 12), (7, 3)])  # batch slices, or the whole input once
@pytest.mark.parametrize("act", [nn.ReLU(), nn.ReLU6(), nn.Hardtanh(-0.7, 1.3)])
def test_fused_rebuild_is_the_torch_ops(storage: str, channels_last: bool, channels: int, height: int,
                                        act: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """The input rebuilt in one fused pass from the codes and the mask is the torch ops' rebuilt
    input bit for bit (signed zeros off a ReLU's mask included) and laid out alike."""
    if cpu_kernels.build_cpu_kernels() is None:
        pytest.skip("no C++ compiler here: the torch path is the only one")
    model = block(channels=channels)
    model[2] = act
    x = torch.randn(5, 3, height, height)
    if channels_last:
        x, model = x.contiguous(memory_format=torch.channels_last), model.to(memory_format=torch.channels_last)
    model = compress(model, {"3": "from_bn"}, norm_storage=storage)
    y = model[2](model[1](model[0](x)))
    source, saved = rebuilt_input.claim(y, "3")
    rebuilt = []
    for fused in (True, False):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(rebuilt_input, "_rebuilds_fused", lambda *args: False)
            samples = rebuilt_input.rebuilt_samples(source, saved, tuple(y.shape))
            rebuilt.append([samples(0, 2), samples(2, 5), samples(0, 5)])
    for f, r in zip(*rebuilt, strict=True):
        assert torch.equal(f.contiguous().view(torch.int32), r.contiguous().view(torch.int32))
        assert f.stride() == r.stride()


def test_the_conv_keeps_no_bytes_of_its_own() -> None:
    """Saved bytes (independent count over storages): exactly the int2 map's less the codes of
    the convs whose inputs are rebuilt; none of them is charged a byte."""
    rebuilt = [f"layer{s}.{b}.conv2" for s in (1, 2, 3) for b in range(3)] + ["layer1.0.conv1"]
    x = torch.randn(4, 3, 32, 32)
    own = measure_memory(compress(build_model("resnet20", 10).train(), {"*": "int2"}, norm_storage="int2"), x)
    model = compress(build_model("resnet20", 10).train(), {**dict.fromkeys(rebuilt, "from_bn"), "*": "int2"},
                     norm_storage="int2")
    derived = measure_memory(model, x)
    assert derived.total_bytes == own.total_bytes - sum(own.per_layer[name] for name in rebuilt)
    assert not any(derived.per_layer.get(name) for name in rebuilt)
    assert derived.total_bytes < 0.8 * own.total_bytes


def test_torchvision_blocks_reuse_one_relu_module() -> None:
    """torchvision's BasicBlock calls one ReLU module twice: the note is per tensor, so conv2
    (after bn1 -> relu) rebuilds while the block's second call feeds a ReLU-after-addition."""
    model = compress(build_model("resnet18", 10).train(), {"layer*.conv2": "from_bn", "*": "int4"}, norm_storage="int4")
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("conv2.weight")]
    assert len(grads) == 8 and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("norm_storage", ["int4", "native", "chunked"])
def test_notes_keep_nothing_alive(norm_storage: str) -> None:
    """A note holds weak references (an exact BatchNorm's input: read from its node): once
    backward has freed what the BatchNorm and ReLU keep, the note on a ReLU output the caller
    still holds (as an in-place ReLU's node does) names nothing."""
    from lessmem.core.ops.input_notes import ClampOfNorm, noted

    model = compress(block(), {"3": "from_bn"}, norm_storage=norm_storage)
    y = model[2](model[1](model[0](torch.randn(4, 3, 8, 8))))
    source = noted(y, ClampOfNorm)
    assert source is not None and source.bits() is not None and all(r() is not None for r in source.norm.packed)
    model[3](y).sum().backward()
    assert source.bits() is None and all(r() is None for r in source.norm.packed)


class Tampered(nn.Module):
    """BatchNorm -> ReLU -> an in-place change -> conv: the input is no longer what the ReLU noted."""

    def __init__(self) -> None:
        super().__init__()
        self.bn, self.relu, self.conv = nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.relu(self.bn(x)).mul_(2.0))


class Unscaled(nn.Sequential):
    """A BatchNorm without affine parameters: nothing to rebuild from (no gamma, beta)."""

    def __init__(self) -> None:
        super().__init__(nn.BatchNorm2d(3, affine=False), nn.ReLU(), nn.Conv2d(3, 4, 3))


@pytest.mark.parametrize(("model", "mapping", "norm_storage", "match"), [
    (lambda: block(), {"0": "from_bn"}, "int2", "layer '0'"),
    (Tampered, {"conv": "from_bn"}, "int2", "layer 'conv'.*unchanged"),
    (Unscaled, {"2": "from_bn"}, "native", "layer '2'.*affine"),
])
def test_misuse_names_the_layer(model, mapping, norm_storage: str, match: str) -> None:
    net = compress(model(), mapping, norm_storage=norm_storage)
    with pytest.raises(ValueError, match=match):
        net(torch.randn(2, 4 if isinstance(net, Tampered) else 3, 8, 8))


@pytest.mark.parametrize(("padding", "mode", "accepted"), [
    ("same", "zeros", True), ("valid", "zeros", True), ((1, 1), "zeros", True), ((1, 1), "reflect", False),
])
def test_from_bn_takes_symmetric_zero_padding(padding, mode: str, accepted: bool) -> None:
    """'same' with an odd kernel pads alike on both sides: the rebuilt input is the conv's own, and the
    weight gradient is the module path's to rounding; other padding modes are a clear error."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.Conv2d(4, 8, 3, padding=padding, padding_mode=mode))
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3, 8, 8)
    compress(net, {"3": "from_bn"})
    if not accepted:
        with pytest.raises(ValueError, match=f"layer '3'.*{mode}"):
            net(x)
        return
    net(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(net[3].weight.grad, ref[3].weight.grad, rtol=1e-5, atol=1e-6)


def test_from_bn_refuses_asymmetric_same_padding() -> None:
    net = compress(nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 8, 2, padding="same")), {"2": "from_bn"})
    with pytest.raises(ValueError, match="layer '2'.*'same'"):
        net(torch.randn(2, 4, 8, 8))


def test_from_bn_is_a_conv_kernel_1_option() -> None:
    assert str(parse_spec("c", "from_bn")) == "1x1/from_bn"
    assert parse_spec("c", {"kernel": 1, "storage": "from_bn"}) == parse_spec("c", "1/from_bn")
    for bad in ("2/from_bn", {"kernel": 2, "storage": "from_bn"}):
        with pytest.raises(ValueError, match="kernel is 1"):
            parse_spec("c", bad)
    with pytest.raises(ValueError, match="layer '0' is Linear"):
        compress(nn.Sequential(nn.Linear(4, 4)), {"0": "from_bn"})
    with pytest.raises(ValueError, match="exact_companions"):
        compress(block(), {"3": "from_bn"}, norm_storage="int2", exact_companions=False)


def test_coverage_names_the_codes_by_their_keepers() -> None:
    from lessmem.core import coverage

    report = coverage(compress(block(), {"3": "from_bn"}, norm_storage="int2"), torch.randn(2, 3, 16, 16),
                      compare_stock=False)
    ops = {row.op for row in report.rows}
    assert "StoredBatchNormFunctionBackward" in ops and "MaskedActivationFunctionBackward" in ops
    assert not any("RebuiltInput" in op for op in ops)


def test_resnet20_preset_fits_its_budget() -> None:
    """``compression=resnet20_from_bn`` composes, applies to resnet20 and keeps under 0.08x of
    stock's saved bytes (what its comment promises), charging the rebuilt convs nothing."""
    from lessmem.experiment import compose_config
    from lessmem.experiment.compression import resolve_compression

    cfg = compose_config(["model=resnet20", "compression=resnet20_from_bn"])
    model = build_model("resnet20", 10).train()
    compress(model, resolve_compression(cfg.compression))
    x = torch.randn(4, 3, 32, 32)
    saved = measure_memory(model, x)
    assert saved.total_bytes < 0.08 * measure_memory(build_model("resnet20", 10).train(), x).total_bytes
    assert not saved.per_layer.get("layer2.1.conv2") and saved.per_layer["layer2.1.conv1"] > 0


@pytest.mark.slow
def test_compiled_from_bn_is_a_clear_error() -> None:
    net = torch.compile(compress(block(), {"3": "from_bn"}, norm_storage="int4"))
    with pytest.raises(ValueError, match="layer '3'.*torch.compile"):
        net(torch.randn(2, 3, 8, 8))


def test_from_an_exact_batchnorm_gradients_are_stocks_to_rounding() -> None:
    """Native BatchNorms (the map's from_bn makes them NotedBatchNorm2d, the same op): forward,
    running statistics and every gradient but the rebuilt convs' weights are stock's bit for bit;
    those are within float rounding; the convs keep nothing (saved-tensor count, under hooks)."""
    torch.manual_seed(0)
    x, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    stock = build_model("resnet20", 10).train()
    rebuilt = [f"layer{s}.{b}.conv2" for s in (1, 2, 3) for b in range(3)] + ["layer1.0.conv1"]
    model = compress(copy.deepcopy(stock), dict.fromkeys(rebuilt, "from_bn"))
    out = {}
    for name, net in (("stock", stock), ("from_bn", model)):
        logits = net(x)
        F.cross_entropy(logits, labels).backward()
        out[name] = (logits.detach(), {n: p.grad for n, p in net.named_parameters()}, dict(net.named_buffers()))
    assert torch.equal(out["stock"][0], out["from_bn"][0])
    assert all(torch.equal(b, out["from_bn"][2][n]) for n, b in out["stock"][2].items())
    for name, grad in out["stock"][1].items():
        if name.removesuffix(".weight") in rebuilt:
            assert torch.allclose(out["from_bn"][1][name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max()), name
        else:
            assert torch.equal(out["from_bn"][1][name], grad), name
    exact = measure_memory(compress(copy.deepcopy(stock), None), x)
    saved = measure_memory(model, x)
    assert saved.total_bytes == exact.total_bytes - sum(exact.per_layer[name] for name in rebuilt)
    assert saved.total_bytes < 0.75 * exact.total_bytes


def test_noted_batchnorms_only_where_a_map_rebuilds() -> None:
    from lessmem.core import uncompress
    from lessmem.core.ops.batchnorm import NotedBatchNorm2d

    assert not any(isinstance(m, NotedBatchNorm2d) for m in compress(block(), {"3": 2}).modules())
    model = compress(block(), {"3": "from_bn"})
    assert isinstance(model[1], NotedBatchNorm2d)
    assert type(uncompress(model)[1]) is nn.BatchNorm2d


def test_rebuildable_convs_are_those_after_batchnorm_and_a_clamp() -> None:
    from lessmem.core import rebuildable_convs

    x = torch.randn(2, 3, 32, 32)
    assert rebuildable_convs(build_model("resnet20", 10), x) == {"layer1.0.conv1": "bn1"} | {
        f"layer{s}.{b}.conv2": f"layer{s}.{b}.bn1" for s in (1, 2, 3) for b in range(3)}
    found = rebuildable_convs(build_model("mobilenet_v2", 10), x)  # after BatchNorm + ReLU6: depthwise and projection
    assert "features.2.conv.1.0" in found and "features.2.conv.2" in found and "features.2.conv.0.0" not in found


def test_mobilenet_v2_rebuilt_after_relu6_is_stocks_to_rounding() -> None:
    """ReLU6 (off the mask: the bound on the rebuilt value's side) from exact BatchNorms: every
    rebuilt conv's weight gradient within float rounding of stock's, every other one bit-identical."""
    from lessmem.core import rebuildable_convs

    torch.manual_seed(0)
    stock = build_model("mobilenet_v2", 10).train()
    for module in stock.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    rebuilt = rebuildable_convs(stock, x)
    model = compress(copy.deepcopy(stock), dict.fromkeys(rebuilt, "from_bn"))
    grads = {}
    for name, net in (("stock", stock), ("from_bn", model)):
        F.cross_entropy(net(x), labels).backward()
        grads[name] = {n: p.grad for n, p in net.named_parameters()}
    for name, grad in grads["stock"].items():
        if name.removesuffix(".weight") in rebuilt:
            assert torch.allclose(grads["from_bn"][name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max()), name
        else:
            assert torch.equal(grads["from_bn"][name], grad), name
