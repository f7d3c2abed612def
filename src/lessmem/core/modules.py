"""Drop-in subclasses of stock layers. ``compress`` swaps an instance's ``__class__`` to one of
these, so parameters, buffers, hooks and ``state_dict`` keys stay exactly those of the stock layer
(an optimizer built before compression keeps working; checkpoints load into either model)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from lessmem.core.ops import (
    CompactMaxPool2dFunction,
    MaskedActivationFunction,
    PooledConv2dFunction,
    PooledLinearFunction,
    StoredBatchNormFunction,
    pool_tokens,
)
from lessmem.core.storage import Storage, pack_tensor

# Parts without a compiled kernel run eagerly under torch.compile (a graph break, said once).
_eager_conv = torch.compiler.disable(PooledConv2dFunction.apply)
_eager_linear = torch.compiler.disable(PooledLinearFunction.apply)
_warned: set[str] = set()


def _warn_eager(module: nn.Module, what: str) -> None:
    name = getattr(module, "lessmem_name", type(module).__name__)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"lessmem: layer {name!r} ({what}) has no compiled kernel on torch "
            f"{torch.__version__}; it runs eagerly under torch.compile (graph break)",
            stacklevel=3,
        )


@dataclass(frozen=True)
class LayerSpec:
    """What a compressible layer keeps for backward: a pooling kernel and a storage format."""

    kernel: tuple[int, int]
    storage: Storage = "native"

    @property
    def exact(self) -> bool:
        return self.kernel == (1, 1) and self.storage == "native"

    def __str__(self) -> str:
        k = f"{self.kernel[0]}x{self.kernel[1]}"
        return k if self.storage == "native" else f"{k}/{self.storage}"


def _needs_saving(x: Tensor, module: nn.Module) -> bool:
    # Under no_grad / inference nothing is saved: take the stock path, no overhead.
    return torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for p in module.parameters(recurse=False))
    )


def _autocast_cast(x: Tensor, weight: Tensor, bias: Tensor | None):
    """Cast like autocast would for conv/linear, so the function below runs in a single dtype."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


class CompressedConv2d(nn.Conv2d):
    """Conv2d that saves its input pooled by ``lessmem_spec.kernel`` for the weight gradient."""

    lessmem_spec: LayerSpec

    def forward(self, x: Tensor) -> Tensor:
        if not _needs_saving(x, self):
            return super().forward(x)
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = (0, 0)
        elif isinstance(padding, str):
            x, padding = _explicit_padding(x, padding, self.kernel_size, self.dilation)
        x, w, b = _autocast_cast(x, self.weight, self.bias)
        spec = self.lessmem_spec
        args = (x, w, b, self.stride, padding, self.dilation, self.groups, spec.kernel, spec.storage)
        if torch.compiler.is_compiling():
            if spec.storage == "int8":
                _warn_eager(self, "int8 storage")
                return _eager_conv(*args)
            pooled = torch.ops.lessmem.pool_blocks(x.detach(), list(spec.kernel), spec.storage)
            return torch.ops.lessmem.conv2d_keep_pooled(
                x, pooled, w, b, list(self.stride), list(padding), list(self.dilation), self.groups,
                list(spec.kernel),
            )
        with torch.autocast(x.device.type, enabled=False):
            return PooledConv2dFunction.apply(*args)


def _explicit_padding(x: Tensor, mode: str, kernel, dilation) -> tuple[Tensor, tuple[int, int]]:
    """'valid'/'same' as integers; an asymmetric 'same' pads the input first, as PyTorch does."""
    if mode == "valid":
        return x, (0, 0)
    total = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
    left = [t // 2 for t in total]
    if all(t % 2 == 0 for t in total):
        return x, (left[0], left[1])
    x = F.pad(x, [left[1], total[1] - left[1], left[0], total[0] - left[0]])
    return x, (0, 0)


class CompressedLinear(nn.Linear):
    """Linear on (..., tokens, features) that saves its input pooled over groups of k tokens."""

    lessmem_spec: LayerSpec

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() < 3 or not _needs_saving(x, self):
            return super().forward(x)
        x, w, b = _autocast_cast(x, self.weight, self.bias)
        k, storage = self.lessmem_spec.kernel[0], self.lessmem_spec.storage
        if torch.compiler.is_compiling():
            if storage == "int8":
                _warn_eager(self, "int8 storage")
                return _eager_linear(x, w, b, k, storage)
            pooled = pack_tensor(pool_tokens(x.detach(), k), storage)[0]
            return torch.ops.lessmem.linear_keep_pooled(x, pooled, w, b, k)
        with torch.autocast(x.device.type, enabled=False):
            return PooledLinearFunction.apply(x, w, b, k, storage)


def _masked_activation(x: Tensor, lo: float, hi: float | None, inplace: bool) -> Tensor:
    if not torch.compiler.is_compiling():
        return MaskedActivationFunction.apply(x, lo, hi, inplace)
    # In-place changes nothing in a compiled (functionalized) graph, and the compiler cannot trace
    # a Function that marks its input dirty. The custom op keeps the partitioner from recomputing
    # the mask (and the BatchNorm before it) in backward.
    if x.dim() == 4:
        return torch.ops.lessmem.clamp_mask(x, lo, hi)[0]
    return MaskedActivationFunction.apply(x, lo, hi, False)


class PackedReLU(nn.ReLU):
    """ReLU that keeps a 1-bit mask for backward instead of its full-size output."""

    def forward(self, x: Tensor) -> Tensor:
        if not _needs_saving(x, self):
            return super().forward(x)
        return _masked_activation(x, 0.0, None, self.inplace)


class PackedHardtanh(nn.Hardtanh):
    """Hardtanh / ReLU6 with a 1-bit mask instead of the full-size input."""

    def forward(self, x: Tensor) -> Tensor:
        if not _needs_saving(x, self):
            return super().forward(x)
        return _masked_activation(x, self.min_val, self.max_val, self.inplace)


class PackedReLU6(nn.ReLU6, PackedHardtanh):
    pass


class CompactMaxPool2d(nn.MaxPool2d):
    """MaxPool2d that keeps uint8 in-window argmax positions, not its input and int64 indices."""

    def forward(self, x: Tensor) -> Tensor:
        kernel, dilation = _pair(self.kernel_size), _pair(self.dilation)
        if (
            not _needs_saving(x, self)
            or self.return_indices
            or kernel[0] * kernel[1] > 256
            or x.dim() != 4
        ):
            return super().forward(x)
        stride = _pair(self.stride if self.stride is not None else self.kernel_size)
        return CompactMaxPool2dFunction.apply(
            x, kernel, stride, _pair(self.padding), dilation, self.ceil_mode
        )


class StoredBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that keeps its input in ``lessmem_storage`` (bf16 / int8) — approximate."""

    lessmem_storage: Storage

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and _needs_saving(x, self) and self.affine and self.track_running_stats):
            return super().forward(x)
        self._check_input_dim(x)
        self.num_batches_tracked.add_(1)
        momentum = (
            1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        )
        x_in = x
        device = x.device.type
        if torch.is_autocast_enabled(device):
            x_in = x.float()  # autocast runs batch norm in fp32
        with torch.autocast(device, enabled=False):
            return StoredBatchNormFunction.apply(
                x_in, self.weight, self.bias, self.running_mean, self.running_var,
                momentum, self.eps, self.lessmem_storage,
            )


# Transformer layers live in their own module, which builds on the helpers above.
from lessmem.core.transformer import STORED_ACTIVATIONS, CompressedMultiheadAttention, PackedDropout  # noqa: E402

# Stock class -> compressed class. Only these exact types are swapped: a user subclass may
# override forward, and silently replacing that would change the model.
COMPRESSIBLE: dict[type[nn.Module], type[nn.Module]] = {
    nn.Conv2d: CompressedConv2d,
    nn.Linear: CompressedLinear,
    nn.MultiheadAttention: CompressedMultiheadAttention,
}
EXACT_COMPANIONS: dict[type[nn.Module], type[nn.Module]] = {
    nn.ReLU: PackedReLU,
    nn.ReLU6: PackedReLU6,
    nn.Hardtanh: PackedHardtanh,
    nn.MaxPool2d: CompactMaxPool2d,
    nn.Dropout: PackedDropout,
}
STOCK_OF: dict[type[nn.Module], type[nn.Module]] = {
    v: k
    for k, v in {
        **COMPRESSIBLE, **EXACT_COMPANIONS, **STORED_ACTIVATIONS, nn.BatchNorm2d: StoredBatchNorm2d
    }.items()
}
