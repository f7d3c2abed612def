"""The storage menu: bytes kept match ``stored_bytes``; decoding is within each storage's bound;
every lossy storage of the menu (bf16 and int8 too) rounds stochastically and unbiased, the
``_rn`` ones to nearest and deterministically; the noise is reproducible from (seed, call
counter), through a saved rounding state too; the fused CPU kernels give the torch reference's
bits."""

from __future__ import annotations

import pytest
import torch

from lessmem.core import rounding
from lessmem.core import storage as storage_module
from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.storage import (
    BITS,
    GROUP,
    ROUND_TO_NEAREST,
    STORAGES,
    is_stochastic,
    pack_tensor,
    stored_bytes,
    tensor_meta,
    unpack_tensor,
)

SHAPES = [(300,), (2, 3, 5, 7), (4, 16, 8, 8), (1, 128), (3, 129)]
QUANTIZED = tuple(BITS)
STOCHASTIC = tuple(s for s in STORAGES if s != "native" and is_stochastic(s))


@pytest.fixture(autouse=True)
def _keep_rounding_state():
    """These tests reseed the process-wide noise stream; later tests get it back as it was."""
    saved = rounding.rounding_state()
    yield
    rounding.load_rounding_state(saved)


def _tensor(shape: tuple[int, ...], channels_last: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) * 31 + shape[-1]))
    x = x.to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _cases():
    for shape in SHAPES:
        yield shape, False
        if len(shape) == 4:
            yield shape, True


def _group_ranges(x: torch.Tensor) -> torch.Tensor:
    """max - min of the group each element of x (in memory order) falls in."""
    flat = (x.permute(0, 2, 3, 1) if tensor_meta(x).channels_last else x).reshape(-1).float()
    pad = -flat.numel() % GROUP
    padded = torch.cat([flat, flat[-1:].expand(pad)]).view(-1, GROUP)
    spread = (padded.amax(dim=1) - padded.amin(dim=1)).repeat_interleave(GROUP)[: flat.numel()]
    if tensor_meta(x).channels_last:
        n, c, h, w = x.shape
        return spread.view(n, h, w, c).permute(0, 3, 1, 2)
    return spread.view(x.shape)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(("shape", "channels_last"), list(_cases()))
def test_stored_bytes_is_what_pack_keeps(storage, shape, channels_last) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        x = _tensor(shape, channels_last, dtype)
        packed = pack_tensor(x, storage)
        assert sum(t.nbytes for t in packed) == stored_bytes(x.numel(), storage, x.element_size())


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize(("shape", "channels_last"), list(_cases()))
def test_round_trip_keeps_shape_layout_and_error_bound(storage, shape, channels_last) -> None:
    x = _tensor(shape, channels_last)
    meta = tensor_meta(x)
    y = unpack_tensor(pack_tensor(x, storage), storage, meta)
    assert y.shape == x.shape and y.dtype == x.dtype and y.stride() == x.stride()
    err = (y - x).abs()
    # round to nearest: half a step; stochastic: under one step
    share = 1.0 if is_stochastic(storage) else 0.5
    if storage == "native":
        assert torch.equal(y, x)
    elif storage in ("bf16", "bf16_rn"):
        assert (err <= x.abs() * 2.0**-7 * share).all()
    else:
        step = _group_ranges(x) / ((1 << BITS[storage]) - 1)
        bound = step * share + 1e-5  # float32 slack
        assert (err <= bound).all(), float((err - bound).max())


def _step(x: torch.Tensor, storage: str) -> torch.Tensor:
    """The distance between the two values each element of x rounds to in ``storage``."""
    if storage == "bf16":
        return torch.ldexp(torch.ones_like(x), torch.frexp(x).exponent - 8)
    return _group_ranges(x) / ((1 << BITS[storage]) - 1)


@pytest.mark.parametrize("storage", STOCHASTIC)
def test_stochastic_rounding_is_unbiased(storage) -> None:
    x = _tensor((300,))
    meta = tensor_meta(x)
    draws = 2000
    rounding.set_rounding_seed(7)
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        total += unpack_tensor(pack_tensor(x, storage), storage, meta).double()
    mean = (total / draws).float()
    # one decode's error is within one step, so the mean's standard error is under step / (2 sqrt(n))
    step = _step(x, storage)
    assert ((mean - x).abs() <= 5 * step / (2 * draws**0.5) + 1e-6).all()
    assert (unpack_tensor(pack_tensor(x, storage), storage, meta) != x).any()  # a single decode is lossy


@pytest.mark.parametrize("storage", STOCHASTIC)
def test_same_seed_and_counter_give_same_codes(storage) -> None:
    x = _tensor((4, 16, 8, 8), channels_last=True)
    rounding.set_rounding_seed(3)
    first, second = pack_tensor(x, storage), pack_tensor(x, storage)
    rounding.set_rounding_seed(3)
    again = pack_tensor(x, storage)
    rounding.set_rounding_seed(4)
    other = pack_tensor(x, storage)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], second[0])  # the counter moves on each call
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("storage", ROUND_TO_NEAREST)
def test_rn_storages_round_to_nearest_without_drawing_noise(storage) -> None:
    x = _tensor((300,))
    rounding.set_rounding_seed(5)
    packed = pack_tensor(x, storage)
    assert rounding.rounding_state() == {"seed": 5, "calls": 0}
    assert all(torch.equal(a, b) for a, b in zip(packed, pack_tensor(x, storage), strict=True))
    if storage == "bf16_rn":
        assert torch.equal(packed[0], x.to(torch.bfloat16))


def test_bf16_keeps_special_values_and_exact_ones() -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5, -2.0, 2.0**-130, 3.0e38])
    rounding.set_rounding_seed(2)
    y = pack_tensor(x, "bf16")[0]
    assert y.dtype == torch.bfloat16 and y[0].isnan()
    assert torch.equal(_bits(y[1:7]), _bits(x[1:7].to(torch.bfloat16)))  # representable: no rounding
    assert y[7] > 0 and y[8] > 0  # a subnormal and a near-maximal value round within their sign


def test_rounding_state_round_trip() -> None:
    x = _tensor((3, 129))
    rounding.set_rounding_seed(11)
    pack_tensor(x, "int4")
    saved = rounding.rounding_state()
    assert saved == {"seed": 11, "calls": 1}
    expected = pack_tensor(x, "int2")
    pack_tensor(x, "int2")
    rounding.load_rounding_state(saved)
    assert rounding.rounding_state() == saved
    assert all(torch.equal(a, b) for a, b in zip(pack_tensor(x, "int2"), expected, strict=True))


def test_noise_is_the_documented_hash() -> None:
    key = 0xFFFFFFF0  # indices wrap past 2^32
    noise = rounding.uniform_noise(40, key)
    expected = [(rounding.hash32((i + key) & rounding.MASK32) >> 8) * 2.0**-24 for i in range(40)]
    assert noise.tolist() == expected
    assert (noise >= 0).all() and (noise < 1).all()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's raw bits (so -0.0 and 0.0, or two NaNs, compare as what they are)."""
    return t.contiguous().view(torch.uint8)


def _hard_inputs(dtype: torch.dtype, specials: bool):
    """(tensor, channels_last) cases: odd sizes (padding), channels-last, a view that is not
    dense, constant groups (the smallest scale), a tensor of many groups, large magnitudes; with
    ``specials``, NaN, infinities, signed zeros and subnormals too."""
    for shape, channels_last in [*_cases(), ((1,), False), ((8, 64, 16, 16), True), ((64, 1000), False)]:
        yield _tensor(shape, channels_last, dtype)
    yield _tensor((40, 70), dtype=dtype).t()
    constant = torch.full((2, 256), 0.5, dtype=dtype)
    constant[1, 200:] = -3.0
    yield constant
    yield (_tensor((5, 77)) * 1e4).to(dtype)
    if specials:
        yield torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3.0e38, -1.0], dtype=dtype)


@pytest.mark.parametrize("storage", (*QUANTIZED, "bf16"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fused_kernels_are_bit_identical_to_the_reference(storage, dtype, monkeypatch) -> None:
    if cpu_kernels.build_cpu_kernels() is None:
        pytest.skip("no C++ compiler here: the torch reference is used")
    for i, x in enumerate(_hard_inputs(dtype, specials=storage == "bf16")):
        key = (0xFFFFFF00 + 7919 * i) & rounding.MASK32  # element index + key wraps past 2^32
        monkeypatch.setattr(storage_module, "next_key", lambda key=key: key)
        meta = tensor_meta(x)
        fused = pack_tensor(x, storage)
        fused_decoded = unpack_tensor(fused, storage, meta)
        monkeypatch.setenv("LESSMEM_CPU_KERNELS", "0")
        reference = pack_tensor(x, storage)
        decoded = unpack_tensor(reference, storage, meta)
        monkeypatch.delenv("LESSMEM_CPU_KERNELS")
        assert [t.dtype for t in fused] == [t.dtype for t in reference]
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(fused, reference, strict=True)), x.shape
        assert torch.equal(_bits(unpack_tensor(reference, storage, meta)), _bits(decoded))
        assert torch.equal(_bits(fused_decoded), _bits(decoded))
        assert fused_decoded.stride() == decoded.stride() and fused_decoded.dtype == decoded.dtype
