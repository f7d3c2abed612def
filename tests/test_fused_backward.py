"""Backward without full-size copies: BatchNorm decoding its packed input a few samples at a
time, gradients overwritten in place by the node they were handed to (``owned_grad``), the
first layer's weight gradient in batch slices; each against the unfused reference."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lessmem
from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.ops import batchnorm, conv, masked_activations, recompute
from lessmem.core.ops.batchnorm import StoredBatchNormFunction, chunked_batch_norm_backward
from lessmem.core.ops.conv import chunked_weight_grad, conv_grads, input_grad
from lessmem.core.rounding import set_rounding_seed
from lessmem.core.storage import pack_tensor, tensor_meta, unpack_tensor
from lessmem.models.registry import build_model


@pytest.mark.parametrize("storage", ["native", "bf16", "bf16_rn", "int8", "int8_rn", "int4", "int2"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_chunked_batch_norm_backward_matches_torch_on_the_decoded_input(
        storage: str, channels_last: bool, inplace: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batchnorm, "CHUNK_ELEMENTS", 2 * 16 * 8 * 16)  # two samples per chunk
    torch.manual_seed(0)
    x = torch.randn(5, 16, 8, 16)
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    w, b = torch.randn(16), torch.randn(16)
    y = StoredBatchNormFunction.apply(x.requires_grad_(), w, b, torch.zeros(16), torch.ones(16), 0.1, 1e-5,
                                      storage)
    weight, mean, invstd, *packed = y.grad_fn.saved_tensors
    grad = torch.randn_like(y)
    decoded = unpack_tensor(packed, storage, y.grad_fn.meta)
    assert y.grad_fn.normalized == storage.startswith("int")  # integer codes keep x_hat
    if y.grad_fn.normalized:
        decoded = decoded / invstd.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)
    expected = torch.ops.aten.native_batch_norm_backward(
        grad, decoded, w, None, None, mean, invstd, True, 1e-5, [True] * 3)
    got = chunked_batch_norm_backward(grad.clone(), packed, storage, y.grad_fn.meta, w, mean, invstd,
                                      [True] * 3, inplace, y.grad_fn.normalized)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=2e-5, atol=1e-5)  # float32 sums in another order


@pytest.mark.parametrize("storage", ["int8", "int8_rn", "int2"])
def test_normalized_input_packed_in_slices_equals_one_pack(storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BatchNorm packs x_hat a slice at a time in forward (no full-size x_hat): the codes are
    those of packing x_hat whole."""
    torch.manual_seed(0)
    x = torch.randn(6, 16, 8, 16).contiguous(memory_format=torch.channels_last)
    mean, invstd = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False).add(1e-5).rsqrt()
    expected = (x - mean.view(1, -1, 1, 1)) * invstd.view(1, -1, 1, 1)
    set_rounding_seed(0)
    packs = [pack_tensor(expected, storage)]
    monkeypatch.setattr(batchnorm, "PACK_ELEMENTS", 4 * 16 * 8 * 16)  # slices of 4 samples, then 2
    set_rounding_seed(0)
    packs.append(batchnorm.pack_normalized(x, mean, invstd, storage))
    for whole, sliced in zip(*packs, strict=True):
        assert torch.equal(whole, sliced)
    decoded = unpack_tensor(packs[0], storage, tensor_meta(x))
    assert (decoded - expected).abs().max() <= packs[0][2].max() * 1.0001  # within one code step of x_hat


def _raw(t: torch.Tensor) -> torch.Tensor:
    """t's bits (signed zeros compare as what they are)."""
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("storage", ["int8_rn", "int4", "int2", "int1"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_fused_normalized_codes_are_the_torch_paths(storage: str, channels_last: bool, dtype: torch.dtype,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused kernel codes x_hat from x in one pass: the codes, min and scale of the torch path
    bit for bit (samples on and off code groups, a padded last group, NHWC's channel order)."""
    if cpu_kernels.build_cpu_kernels() is None:
        pytest.skip("no C++ compiler here: the torch path is the only one")
    torch.manual_seed(0)
    for shape in [(6, 16, 8, 16), (3, 5, 7, 3)]:
        x = (torch.randn(shape) * 3 + 1).to(dtype)
        x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        _, mean, invstd = torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
        packs = []
        for fused in (True, False):
            with monkeypatch.context() as patch:
                if not fused:
                    patch.setattr(batchnorm, "_normalizes_fused", lambda *args: False)
                set_rounding_seed(0)
                packs.append(batchnorm.pack_normalized(x, mean, invstd, storage))
        assert all(torch.equal(_raw(a), _raw(b)) for a, b in zip(*packs, strict=True)), shape


@pytest.mark.parametrize("storage", ["int8", "int4", "int2"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_fused_code_passes_of_the_batch_norm_backward_are_the_torch_ops(
        storage: str, channels_last: bool, inplace: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward's passes over x_hat's codes, fused (decoded times the gradient; the input
    gradient), give the torch ops' gradients bit for bit, in one chunk and in chunks of two samples."""
    if cpu_kernels.build_cpu_kernels() is None:
        pytest.skip("no C++ compiler here: the torch path is the only one")
    torch.manual_seed(0)
    x = torch.randn(5, 16, 8, 16)
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    w, b = torch.randn(16), torch.randn(16)
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
    packed = batchnorm.pack_normalized(x, mean, invstd, storage)
    grad = torch.randn_like(x)
    for chunk in (batchnorm.CHUNK_ELEMENTS, 2 * 16 * 8 * 16):
        results = []
        for fused in (True, False):
            with monkeypatch.context() as patch:
                patch.setattr(batchnorm, "CHUNK_ELEMENTS", chunk)
                if not fused:
                    patch.setattr(batchnorm, "_codes_backward_fused", lambda *args: False)
                results.append(chunked_batch_norm_backward(grad.clone(), packed, storage, tensor_meta(x), w, mean,
                                                           invstd, [True] * 3, inplace, True))
        for f, r in zip(*results, strict=True):
            assert torch.equal(_raw(f), _raw(r)) and f.stride() == r.stride()


def stem_model(channels: int = 32) -> nn.Sequential:
    """A wide stem (conv, BatchNorm, ReLU, max-pool) before narrow layers: the stem's backward
    holds the step's largest tensors."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, channels, 7, 2, 3, bias=False), nn.BatchNorm2d(channels), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1), nn.Conv2d(channels, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


class Residual(nn.Module):
    """A ReLU output read by a conv and by the skip, and an addition that hands one gradient
    object to both of its inputs: what in-place gradients must not overwrite."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(z)) + z)


def grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    set_rounding_seed(1)  # the same stochastic rounding in both runs
    model(x).square().sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("build", [stem_model, lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Residual(),
                                                                     Residual())])
@pytest.mark.parametrize("norm_storage", ["int4", "chunked"])
def test_in_place_gradients_change_no_value(build, norm_storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 3, 32, 32)
    model = lessmem.compress(build(), {"*": "int2"}, norm_storage=norm_storage)
    fused = grads(model, x)
    for module in (masked_activations, batchnorm):
        monkeypatch.setattr(module, "owns", lambda ctx, grad: False)
    for p in model.parameters():
        p.grad = None
    reference = grads(model, x)
    for f, r in zip(fused, reference, strict=True):
        assert torch.equal(f, r)


@pytest.mark.parametrize("rebuilt", [False, True])
def test_chunked_batch_norm_is_stocks_to_float_rounding(rebuilt: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """norm_storage="chunked": forward and running statistics stock's bit for bit, every gradient
    (the input's too) within float rounding of stock's; also where from_bn convs rebuild their
    inputs from these BatchNorms."""
    monkeypatch.setattr(batchnorm, "CHUNK_ELEMENTS", 3 * 16 * 32 * 32)  # 3, 6 and 12 samples a chunk
    torch.manual_seed(0)
    x, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    stock = build_model("resnet20", 10).train()
    mapping = {f"layer{s}.{b}.conv2": "from_bn" for s in (1, 2, 3) for b in range(3)} if rebuilt else None
    model = lessmem.compress(copy.deepcopy(stock), mapping, norm_storage="chunked")
    assert {m.lessmem_storage for m in model.modules() if isinstance(m, nn.BatchNorm2d)} == {"chunked"}
    out = {}
    for name, net in (("stock", stock), ("chunked", model)):
        leaf = x.clone().requires_grad_()
        logits = net(leaf)
        nn.functional.cross_entropy(logits, labels).backward()
        out[name] = (logits.detach(), {"input": leaf.grad, **{n: p.grad for n, p in net.named_parameters()}},
                     dict(net.named_buffers()))
    assert torch.equal(out["stock"][0], out["chunked"][0])
    assert all(torch.equal(b, out["chunked"][2][n]) for n, b in out["stock"][2].items())
    for name, grad in out["stock"][1].items():  # measured: 2.3e-6 at most (stock vs float64: 3.9e-6)
        assert (out["chunked"][1][name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


def test_chunked_batch_norm_backward_drops_two_full_size_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the stem's BatchNorm, where the step peaks: torch's CPU kernel allocates the input gradient
    twice (the first never written); the chunked backward writes over the incoming gradient (handed
    on by the ReLU), with two one-sample temporaries."""
    monkeypatch.setattr(batchnorm, "CHUNK_ELEMENTS", 32 * 32 * 32)  # one sample of the stem
    data = (torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,)))
    peaks = {}
    for storage in ("native", "chunked"):
        model = lessmem.compress(stem_model(), None, norm_storage=storage)
        report = lessmem.measure_step_memory(model, data, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert report.phase == "backward"
        peaks[storage] = report.peak_bytes
    stem = 4 * 32 * 32 * 32 * 4  # bytes of the stem's conv output, 4 samples
    assert peaks["native"] - peaks["chunked"] >= 2 * stem - 2 * stem // 4 - 1024  # and per-channel sums


def test_chunked_is_an_exact_norm_storage_of_the_plan(tmp_path) -> None:
    """A plan setting (digest, file), for BatchNorms only; full size in coverage; torch's BatchNorm
    under autocast (it would save an fp32 copy) and ``uncompress``."""
    plan = lessmem.CompressionPlan({"*": 2}, norm_storage={"0.bn1": "chunked"})
    assert plan.digest != plan.replace(norm_storage="native").digest
    assert lessmem.CompressionPlan.read(plan.write(tmp_path / "plan.yaml")).digest == plan.digest
    with pytest.raises(ValueError, match="act_storage: unknown storage 'chunked'"):
        plan.replace(act_storage="chunked")
    model = lessmem.compress(nn.Sequential(Residual()), plan)
    assert model[0].bn1.lessmem_storage == "chunked" and type(model[0].bn2) is nn.BatchNorm2d
    x = torch.randn(2, 8, 8, 8)
    rows = [r for r in lessmem.coverage(model, x, compare_stock=False).rows if r.layer == "0.bn1"]
    assert rows and not any(r.compressed for r in rows) and max(rows, key=lambda r: r.bytes).how == "full"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model[0].bn1(x).grad_fn.name() == "NativeBatchNormBackward0"
    assert model[0].bn1(x).grad_fn.name() == "ChunkedBatchNormFunctionBackward"
    assert type(lessmem.uncompress(model)[0].bn1) is nn.BatchNorm2d


def test_chunked_weight_grad_matches_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conv, "WEIGHT_GRAD_CHUNK", 3 * 16 * 16 * 16)
    torch.manual_seed(0)
    x, weight = torch.randn(7, 3, 32, 32), torch.randn(16, 3, 7, 7)
    grad = torch.randn(7, 16, 16, 16)
    expected = conv_grads(grad, x, weight, False, (2, 2), (3, 3), (1, 1), 1, (False, True, False))[1]
    got = chunked_weight_grad(grad, lambda s, e: x[s:e], weight, (2, 2), (3, 3), (1, 1), 1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)  # sums of ~2000 products, other order


@pytest.mark.parametrize("geometry", [
    dict(stride=1, padding=1, dilation=1, groups=1, kernel=3, size=9),
    dict(stride=2, padding=1, dilation=1, groups=1, kernel=3, size=10),
    dict(stride=2, padding=0, dilation=1, groups=1, kernel=1, size=11),
    dict(stride=3, padding=2, dilation=2, groups=4, kernel=3, size=13),
])
@pytest.mark.parametrize("sliced", [False, True])
def test_input_grad_equals_convolution_backward(geometry: dict, sliced: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if sliced:  # two samples a slice
        monkeypatch.setattr(conv, "CHUNKED_WEIGHT_GRAD_MIN", 1)
        monkeypatch.setattr(conv, "WEIGHT_GRAD_CHUNK", 2 * 8 * geometry["size"] ** 2)
    torch.manual_seed(0)
    g = geometry
    x, weight = torch.randn(3, 8, g["size"], g["size"]), torch.randn(12, 8 // g["groups"], g["kernel"], g["kernel"])
    conv_args = ((g["stride"],) * 2, (g["padding"],) * 2, (g["dilation"],) * 2, g["groups"])
    out = torch.nn.functional.conv2d(x, weight, None, *conv_args)
    grad = torch.randn_like(out)
    expected = conv_grads(grad, x, weight, False, *conv_args, (True, False, False))[0]
    torch.testing.assert_close(input_grad(grad, weight, x.shape, *conv_args), expected)


@pytest.mark.parametrize("storage", ["int8", "int2", "int1"])
@pytest.mark.parametrize("stride", [1, 2])
def test_sliced_kernel_one_conv_matches_the_decoded_input(storage: str, stride: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel 1: the weight gradient from the packed input a slice at a time equals the one
    call on the whole decoded input; the input gradient is the exact one."""
    monkeypatch.setattr(conv, "WEIGHT_GRAD_CHUNK", 2 * 16 * 8 * 8 // stride**2)  # two samples a slice
    torch.manual_seed(0)
    layer = nn.Conv2d(8, 16, 3, stride, 1)
    x = torch.randn(5, 8, 16, 16, requires_grad=True)
    model = lessmem.compress(nn.Sequential(layer), {"*": storage})
    y = model(x)
    weight, *packed = y.grad_fn.saved_tensors
    decoded = unpack_tensor(packed, storage, y.grad_fn.pooled_meta)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected = conv_grads(grad, decoded, weight, True, (stride,) * 2, (1, 1), (1, 1), 1, (True, True, True))
    for got, e in zip((x.grad, layer.weight.grad, layer.bias.grad), expected, strict=True):
        torch.testing.assert_close(got, e, rtol=1e-4, atol=1e-4)  # slice sums in another order


def full_size_alive_in_backward(model: nn.Module, data, full: int) -> int:
    """How many tensors of ``full`` bytes are alive at the peak of ``model``'s backward."""
    loss = nn.functional.cross_entropy(model(data[0]), data[1])
    with lessmem.track_step_memory("cpu") as tracker:
        loss.backward()
    return sum(t.nbytes == full for t in tracker.report.live)


def test_no_full_size_decoded_copy_outlives_its_op(monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))
    full = 8 * 32 * 32 * 32 * 4  # the stem's BatchNorm input / output gradient
    # the sizes of resnet18's stem at 224 px scaled to this one: one sample at a time
    monkeypatch.setattr(batchnorm, "CHUNK_ELEMENTS", 32 * 32 * 32)
    monkeypatch.setattr(conv, "WEIGHT_GRAD_CHUNK", 32 * 32 * 32)
    monkeypatch.setattr(conv, "CHUNKED_WEIGHT_GRAD_MIN", 2 * 32 * 32 * 32)
    model = lessmem.compress(stem_model(), {"*": "int2"}, norm_storage="int4")
    assert full_size_alive_in_backward(model, data, full) == 1  # the gradient in flight, nothing else
    # the check sees the copies: without the chunked path, several full-size tensors meet
    monkeypatch.setattr(batchnorm, "sliceable", lambda meta, storage: False)
    model = lessmem.compress(stem_model(), {"*": "int2"}, norm_storage="int4")
    assert full_size_alive_in_backward(model, data, full) > 1


def test_kernel_one_conv_keeps_no_full_size_decoded_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel-1 conv (int maps) decodes its input a slice at a time for the weight gradient:
    no full-size decoded copy at the backward's peak, which falls."""
    monkeypatch.setattr(conv, "WEIGHT_GRAD_CHUNK", 2 * 16 * 32 * 32)
    data = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    full = 8 * 16 * 32 * 32 * 4

    def backward_peak() -> tuple[int, int]:
        """(peak bytes, full-size decoded copies alive at it)."""
        torch.manual_seed(0)
        model = lessmem.compress(nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.AdaptiveAvgPool2d(1),
            nn.Flatten(), nn.Linear(16, 10)), {"*": "int2"})
        loss = nn.functional.cross_entropy(model(data[0]), data[1])
        with lessmem.track_step_memory("cpu") as tracker:
            loss.backward()
        live = tracker.report.live
        return tracker.report.peak_bytes, sum(t.nbytes == full and "unpack_tensor" in t.source for t in live)

    sliced = backward_peak()
    monkeypatch.setattr(conv, "sliced_weight_grad_takes", lambda ctx: False)
    whole = backward_peak()
    assert sliced[1] == 0 and whole[1] == 1  # the check sees the copy where there is one
    assert sliced[0] < whole[0]


def small_llama(layers: int = 1) -> nn.Module:
    from lessmem.models import build_model

    torch.manual_seed(0)
    return build_model("tiny_llama", num_classes=64, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                       num_attention_heads=2, num_key_value_heads=2).train()


def llama_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(ids)
    nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), ids.reshape(-1)).backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(("storage", "saved", "act"), [("int8_rn", "native", "native"), ("int8_rn", "int8_rn", "native"),
                                                     ("bf16_rn", "bf16_rn", "native"), ("int8_rn", "int8_rn", "int8_rn")])
def test_sliced_gated_mlp_matches_the_module_path(storage: str, saved: str, act: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's MLP run as one token-sliced Function against the three projections and the
    recomputed product (deterministic storages: the same codes both ways). With the activation
    storing in the saved storage, the module path repacks the decoded gate, the sliced one runs
    the plain activation on it: equal to float tolerance."""
    monkeypatch.setattr(recompute, "SLICE_ELEMENTS", 32 * 256)  # 32 token rows a slice
    ids = torch.randint(0, 64, (3, 40))

    def run(sliced: bool):
        model = lessmem.compress(small_llama(), {"*": storage}, saved_storage=saved, act_storage=act)
        mlp = model.lm.model.layers[0].mlp
        if not sliced:  # a hook on a projection keeps the module path
            mlp.gate_proj.register_forward_hook(lambda *args: None)
        assert mlp._sliceable(torch.zeros(3, 40, 128, requires_grad=True)) == sliced
        return llama_grads(model, ids)

    (out, grads), (ref_out, ref_grads) = run(True), run(False)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)  # sums in slices


@pytest.mark.parametrize(("act", "plain"), [("native", True), ("int8", True), ("int4", False)])
def test_sliced_gated_mlp_runs_the_plain_activation_only_where_repacking_gives_the_gate_back(act: str,
                                                                                         plain: bool) -> None:
    """Saved tensors in int8: an activation storing nothing or int8 runs as its own class's
    forward in the sliced Function; one storing int4 (a coarser code of the decoded gate) runs
    as the module, its storage and all."""
    model = lessmem.compress(small_llama(), {"*": "int8"}, saved_storage="int8", act_storage=act)
    assert (model.lm.model.layers[0].mlp._unstored_act("int8") is not None) == plain


def test_sliced_gated_mlp_holds_no_full_size_intermediate(monkeypatch: pytest.MonkeyPatch) -> None:
    """No tensor of (all tokens) x intermediate width is made in the MLP's forward or backward:
    the largest is the input gradient (tokens x hidden), or a weight gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    monkeypatch.setattr(recompute, "SLICE_ELEMENTS", 32 * 256)
    tokens, hidden, width = 4 * 64, 128, 256

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self.numel = max(self.numel, t.numel())
            return out

    def largest(model: nn.Module) -> int:
        x = torch.randn(4, 64, hidden, requires_grad=True)
        with Largest() as mode:
            model.lm.model.layers[0].mlp(x).sum().backward()
        return mode.numel

    model = lessmem.compress(small_llama(), {"*": "int8"}, saved_storage="int8", act_storage="int8")
    assert largest(model) == max(tokens * hidden, hidden * width)
    model.lm.model.layers[0].mlp.gate_proj.register_forward_hook(lambda *args: None)
    assert largest(model) == tokens * width  # the check sees the module path's full-size tensors


def attention_inputs(monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    """q (5, 2, 16, 32), kv (k and v strided views of one projection, as HF's are), k, v and an output
    gradient; two samples a slice."""
    monkeypatch.setattr(recompute, "SLICE_ELEMENTS", 2 * 2 * 16 * 32)
    torch.manual_seed(0)
    q = torch.randn(5, 2, 16, 32, requires_grad=True)
    kv = torch.randn(5, 16, 2, 2, 32, requires_grad=True)
    return q, kv, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), torch.randn(5, 2, 16, 32)


@pytest.mark.parametrize("storage", ["native", "int8_rn"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sliced_attention_matches_sdpa_on_the_decoded_inputs(storage: str, is_causal: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k, v packed a batch slice at a time and the attention rerun per slice in backward:
    the output is SDPA's, the gradients SDPA's own on the decoded q, k, v (k, v strided views of
    one projection, as HF's are)."""
    from lessmem.core.ops.recompute import SlicedAttentionFunction
    from lessmem.core.storage import pack_tensor

    q, kv, k, v, grad = attention_inputs(monkeypatch)
    out = SlicedAttentionFunction.apply(q, k, v, is_causal, None, storage)
    got = torch.autograd.grad(out, (q, kv), grad)
    decoded = [unpack_tensor(pack_tensor(t.detach(), storage), storage, tensor_meta(t)) if storage != "native"
               else t for t in (q, k, v)]
    ref_q = decoded[0].detach().requires_grad_()
    ref_kv = torch.stack([decoded[1].transpose(1, 2), decoded[2].transpose(1, 2)], 2).detach().requires_grad_()
    ref_out = nn.functional.scaled_dot_product_attention(
        ref_q, ref_kv[:, :, 0].transpose(1, 2), ref_kv[:, :, 1].transpose(1, 2), is_causal=is_causal)
    expected = torch.autograd.grad(ref_out, (ref_q, ref_kv), grad)
    torch.testing.assert_close(out, nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
                               rtol=0, atol=0)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("storage", ["int8_rn", "bf16_rn"])
def test_attention_sharing_its_output_code_takes_the_flash_backward(storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``share_output`` the attention keeps its output's code, laid out (B, T, H, d), and the
    flash kernel's log-sum-exp: the output is SDPA's bit for bit, HF's ``transpose(1, 2).contiguous()``
    of it is no copy, the out-projection's input finds the same code (``pooled_tokens_once``), and
    the gradients are the flash backward's on the decoded q, k, v and output with the forward's
    log-sum-exp (no rerun)."""
    from lessmem.core.ops.pooling import pooled_tokens_once
    from lessmem.core.ops.recompute import SlicedAttentionFunction

    q, kv, k, v, grad = attention_inputs(monkeypatch)
    out = SlicedAttentionFunction.apply(q, k, v, True, None, storage, True)
    assert torch.equal(out, nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    tokens = out.transpose(1, 2).contiguous()
    assert tokens.data_ptr() == out.data_ptr()
    tokens = tokens.reshape(5, 16, 64)
    packed, meta = pooled_tokens_once(tokens, 1, storage)
    assert all(torch.equal(a, b) for a, b in zip(packed, pack_tensor(tokens.detach(), storage), strict=True))
    kept = {t.data_ptr() for t in out.grad_fn.saved_tensors}
    assert all(t.data_ptr() in kept for t in packed)  # one code for both layers
    got = torch.autograd.grad(out, (q, kv), grad)

    def decoded(t: torch.Tensor) -> torch.Tensor:
        return unpack_tensor(pack_tensor(t.detach(), storage), storage, tensor_meta(t))

    ref_q = decoded(q).requires_grad_()
    ref_kv = torch.stack([decoded(k).transpose(1, 2), decoded(v).transpose(1, 2)], 2).requires_grad_()
    _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.detach(), k.detach(), v.detach(), 0.0, True)
    ref_out = unpack_tensor(packed, storage, meta).view(5, 16, 2, 32).transpose(1, 2)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, ref_q.detach(), ref_kv[:, :, 0].transpose(1, 2).detach(), ref_kv[:, :, 1].transpose(1, 2).detach(),
        ref_out, lse, 0.0, True)
    torch.testing.assert_close(got[0], dq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], torch.stack([dk.transpose(1, 2), dv.transpose(1, 2)], 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("o_proj", "shared"), [("int8", True), ("int4", False), ("2/int8", False)])
def test_llama_attention_shares_its_output_code_with_a_like_out_projection(o_proj: str, shared: bool) -> None:
    """The attention keeps its output's code only where the out-projection keeps its whole input in
    the same storage; that code is then counted once (saved bytes: the rerun path's plus the
    log-sum-exp), and training runs either way."""
    ids = torch.randint(0, 64, (2, 16))

    def saved_bytes(share: bool | None) -> int:
        model = lessmem.compress(small_llama(), {"*o_proj": o_proj, "*": "int8"}, saved_storage="int8")
        attention = model.lm.model.layers[0].self_attn
        assert attention._shares_output("int8") == shared
        if share is False:
            attention._shares_output = lambda storage: False
        report = lessmem.measure_memory(model, ids, loss_fn=lambda out: out.float().pow(2).mean())
        return report.total_bytes

    lse_bytes = 2 * 2 * 16 * 4  # batch x heads x tokens float32
    assert saved_bytes(None) == saved_bytes(False) + (lse_bytes if shared else 0)
    frozen = lessmem.compress(small_llama(), {"*o_proj": o_proj, "*": "int8"}, saved_storage="int8")
    frozen.lm.model.layers[0].self_attn.o_proj.weight.requires_grad_(False)
    assert not frozen.lm.model.layers[0].self_attn._shares_output("int8")  # it would keep no code to share


def test_llama_attention_takes_the_sliced_path_with_lossy_saved_tensors() -> None:
    """The attention's q, k, v are kept by ``SlicedAttentionFunction`` where saved tensors are
    lossy, and by SDPA (stock) where they are native."""
    ids = torch.randint(0, 64, (2, 16))

    def attention_nodes(saved: str) -> set[str]:
        model = lessmem.compress(small_llama(), {"*": "int8"}, saved_storage=saved)
        out = model(ids)
        names, stack, seen = set(), [out.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            names.add(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
        return {n for n in names if "Attention" in n}

    assert attention_nodes("int8") == {"SlicedAttentionFunctionBackward"}
    assert attention_nodes("native") == {"ScaledDotProductFlashAttentionForCpuBackward0"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", ["native", "int8_rn"])
def test_sliced_rms_norm_matches_the_norm_on_the_decoded_input(storage: str, dtype: torch.dtype,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama's RMSNorm kept as its input only, packed a slice of rows at a time, its gradient taken
    from the closed form: output bit for bit the stock norm's, gradients the stock norm's (through
    autograd) on the decoded input to float rounding; the input itself untouched."""
    from lessmem.core.ops.recompute import SlicedRMSNormFunction
    from lessmem.core.storage import pack_tensor

    monkeypatch.setattr(recompute, "NORM_SLICE_ELEMENTS", 7 * 128)  # 7 rows a slice, the last one shorter
    norm = small_llama().lm.model.layers[0].input_layernorm
    torch.manual_seed(0)
    norm.weight.data.normal_()
    x = torch.randn(3, 40, 128, dtype=dtype, requires_grad=True)
    before = x.detach().clone()
    grad = torch.randn(3, 40, 128, dtype=dtype)
    out = SlicedRMSNormFunction.apply(x, norm.weight, norm.variance_epsilon, storage)
    got = torch.autograd.grad(out, (x, norm.weight), grad)
    decoded = unpack_tensor(pack_tensor(x.detach(), storage), storage, tensor_meta(x)).detach().requires_grad_()
    expected = torch.autograd.grad(norm(decoded), (decoded, norm.weight), grad)
    assert torch.equal(out, norm(x))
    assert torch.equal(x, before)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)
