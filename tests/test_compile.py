"""torch.compile traces the compressed layers (custom ops, no graph break) and keeps what eager
mode keeps, with the same gradients; every storage of the menu (conv maps, norm, activation and
saved storages, at every width) trains compiled as accurately as eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torchvision
from torch import nn

import lessmem
from lessmem.core import STORAGES, set_rounding_seed
from lessmem.core.memory import saved_tensors_of


def grads_of(model: nn.Module, params_of: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Input and parameter gradients of one step, from the same rounding noise each call."""
    set_rounding_seed(0)
    params_of.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    model(xx).square().mean().backward()
    return {"input": xx.grad} | {n: p.grad.clone() for n, p in params_of.named_parameters()}


@pytest.mark.slow
def test_resnet18_compiled_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = lessmem.compress(torchvision.models.resnet18(num_classes=10), {"*": 2})
    # 128 px: layer4 is 4x4, so its 2x2 blocks are not whole planes (whose means make the weight
    # gradient a near-cancelling sum after BatchNorm, where any reordering shows up).
    x = torch.randn(2, 3, 128, 128)
    eager = grads_of(model, model, x)
    compiled_model = torch.compile(model, fullgraph=True)  # fullgraph: fails on any graph break
    compiled = grads_of(compiled_model, model, x)
    for name, g in eager.items():
        torch.testing.assert_close(compiled[name], g, rtol=1e-3, atol=1e-5, msg=name)
    eager_kept = saved_tensors_of(model, (x,))[0]
    compiled_kept = saved_tensors_of(compiled_model, (x,))[0]
    # Never more than eager keeps: no full-size conv input sneaks back in. The partitioner may keep
    # less: pooling is now cheap pointwise sums, so it can recompute a pooled conv input (and ReLU
    # masks, BatchNorm statistics) from the BatchNorm input it keeps anyway.
    assert activation_bytes(compiled_kept) <= activation_bytes(eager_kept)
    assert total_bytes(compiled_kept) <= total_bytes(eager_kept)
    stock = copy.deepcopy(model)
    lessmem.uncompress(stock)
    stock_kept = saved_tensors_of(stock, (x,))[0]
    assert total_bytes(compiled_kept) < 0.7 * total_bytes(stock_kept)


def activation_bytes(records) -> int:
    return sum(r.nbytes for r in records if r.dtype.is_floating_point and r.nbytes >= 4096)


def total_bytes(records) -> int:
    return sum(r.nbytes for r in records)


@pytest.mark.slow
def test_uncompilable_storage_falls_back_with_a_named_warning():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
    lessmem.compress(model, {"0": {"kernel": 2, "storage": "int8"}, "2": 2})
    x = torch.randn(2, 3, 12, 12)
    eager = grads_of(model, model, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = grads_of(torch.compile(model), model, x)
    assert any("layer '0'" in str(w.message) and "int8" in str(w.message) for w in caught)
    for name, g in eager.items():
        torch.testing.assert_close(compiled[name], g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("storage", ["native", "bf16"])
def test_compiled_linear_tokens(storage):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    lessmem.compress(model, {"*": {"kernel": 2, "storage": storage}})
    x = torch.randn(2, 7, 8)
    eager = grads_of(model, model, x)
    compiled = grads_of(torch.compile(model, fullgraph=True), model, x)
    for name, g in eager.items():
        torch.testing.assert_close(compiled[name], g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fused", ["1", "0"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_pooling_and_mask_custom_ops(fused, channels_last, monkeypatch):
    """The ops the compiled graph calls: fake kernels agree with the real ones (opcheck), and the
    mask ops give ReLU / Hardtanh values and gradients, with and without the fused kernels."""
    from lessmem.core.ops import custom_ops  # noqa: F401  (registers the ops)

    monkeypatch.setenv("LESSMEM_CPU_KERNELS", fused)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 6)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn_like(x)
    torch.library.opcheck(torch.ops.lessmem.pool_blocks.default, (x, [2, 2], "native"))
    torch.library.opcheck(torch.ops.lessmem.pool_blocks.default, (x, [4, 4], "bf16"))
    for lo, hi, ref in [(0.0, None, torch.relu), (-0.5, 0.5, lambda t: torch.clamp(t, -0.5, 0.5))]:
        torch.library.opcheck(torch.ops.lessmem.clamp_mask.default, (x, lo, hi))
        xx = x.clone().requires_grad_(True)
        y, bits = torch.ops.lessmem.clamp_mask(xx, lo, hi)
        y.backward(g)
        x_ref = x.clone().requires_grad_(True)
        ref(x_ref).backward(g)
        assert torch.equal(y, ref(x)) and torch.equal(xx.grad, x_ref.grad)
        torch.library.opcheck(torch.ops.lessmem.masked_grad.default, (g, bits, channels_last))


LLAMA = {"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128, "num_attention_heads": 2,
         "num_key_value_heads": 2}


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))


def _llama() -> nn.Module:
    from lessmem.models.causal_lm import tiny_llama

    torch.manual_seed(0)
    return tiny_llama(64, **LLAMA).train()


def _step_grads(model: nn.Module, params_of: nn.Module, kind: str) -> torch.Tensor:
    """Every parameter gradient of one step, from rounding seed 0."""
    set_rounding_seed(0)
    params_of.zero_grad(set_to_none=True)
    if kind in ("conv", "norm"):
        model(torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    else:
        ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    return torch.cat([p.grad.flatten() for p in params_of.parameters() if p.grad is not None])


def _compress(model: nn.Module, kind: str, storage: str) -> nn.Module:
    if kind == "conv":  # pooled 2x2, the pooled copy in the storage
        return lessmem.compress(model, {"*": "2" if storage == "native" else f"2/{storage}"})
    return lessmem.compress(model, None, **{f"{kind}_storage": storage})


def _check_compiled_step(kind: str, storage: str) -> None:
    """A compiled step trains (finite gradients) and is as accurate as the eager one: equal for
    the exact storage; for a lossy one, its gradient error against the exact model's within twice
    eager's (a compiled graph may save other tensors than eager mode, so their noise differs)."""
    torch._dynamo.reset()
    build = _cnn if kind in ("conv", "norm") else _llama
    stock = build()
    exact = _step_grads(stock, stock, kind)
    model = _compress(build(), kind, storage)
    eager = _step_grads(model, model, kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # conv codes fall back to the eager layer, with a warning
        compiled = _step_grads(torch.compile(model), model, kind)
    assert compiled.isfinite().all(), (kind, storage)
    if storage == "native":
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-6)
        return
    errors = [float((g - exact).norm() / exact.norm()) for g in (compiled, eager)]
    assert errors[0] <= 2 * errors[1] + 1e-4, (kind, storage, errors)


@pytest.mark.parametrize(("kind", "storage"), [("norm", "int4"), ("saved", "int2")])
def test_compiled_step_with_a_low_bit_storage(kind, storage):
    _check_compiled_step(kind, storage)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["conv", "norm", "act", "saved"])
@pytest.mark.parametrize("storage", STORAGES)
def test_compiled_step_over_the_whole_menu(kind, storage):
    _check_compiled_step(kind, storage)
