"""BatchNorm with a lower-precision copy of its input (approximate, opt-in), or with its input as it
is and only the backward changed (``norm_storage="chunked"``, exact): the autograd Functions, their
chunked backward, and the swapped-in ``StoredBatchNorm2d``.

Integer codes keep the *normalized* input x_hat = (x - mean) * invstd, not x: a code group spans
several channels (memory order), and in x a low-variance channel gets a few levels of a range set
by the widest one, an error that normalization then multiplies by 1 / std. In x_hat every channel
has unit variance. On a trained resnet20 (every BatchNorm input int2, the rest exact) that halves
the whole gradient's squared error (0.029 -> 0.015; int1 0.31 -> 0.17) at the same bytes. bf16 keeps
x (its error is relative to each value already)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lessmem.core.kernels import cpu as cpu_kernels
from lessmem.core.layout import format_of, is_dense
from lessmem.core.ops.dispatch import needs_saving
from lessmem.core.ops.input_notes import NormCode, note, refs, saved_input
from lessmem.core.ops.owned_grad import grad_target, handed_to, owns
from lessmem.core.plan import CHUNKED
from lessmem.core.rounding import next_key
from lessmem.core.storage import (
    BITS,
    GROUP,
    Storage,
    TensorMeta,
    is_stochastic,
    pack_codes,
    pack_tensor,
    samples_of,
    sliceable,
    tensor_meta,
    unpack_samples,
    unpack_tensor,
)

# Elements decoded at a time in the chunked backward: a few MiB, far below a full-size tensor.
CHUNK_ELEMENTS = 2**21
# Elements normalized and packed at a time in forward (a sample of resnet18's stem at most).
PACK_ELEMENTS = 2**18


class StoredBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm that keeps its input as bf16 or 8-bit codes instead of fp32.

    Approximate: the input gradient uses the dequantized input, so error propagation is no longer
    exact. Opt-in through ``norm_storage``.

    Backward decodes the input a few samples at a time (``chunked_batch_norm_backward``) and
    writes the input gradient over the incoming one where this node owns it, so no full-size
    decoded copy or scratch buffer is alive; where samples do not start on a code group (or the
    input is not 4-d) it decodes the whole input for torch's kernel, as before.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, storage):
        out, mean, invstd = torch.ops.aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, True, momentum, eps
        )
        ctx.normalized = storage in BITS
        packed = pack_normalized(x.detach(), mean, invstd, storage) if ctx.normalized else pack_tensor(x.detach(), storage)
        ctx.save_for_backward(weight, mean, invstd, *packed)
        ctx.eps, ctx.storage, ctx.meta = eps, storage, tensor_meta(x)
        ctx.grad_target = grad_target(x)
        # for a conv reading ReLU(out) with storage from_bn (``rebuilt_input``)
        ctx.code = NormCode(refs(*packed), storage, ctx.meta, ctx.normalized, mean, invstd, weight, bias)
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, mean, invstd, *packed = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        if len(ctx.meta.shape) == 4 and sliceable(ctx.meta, ctx.storage):
            gx, gw, gb = chunked_batch_norm_backward(
                grad, packed, ctx.storage, ctx.meta, weight, mean, invstd, mask, owns(ctx, grad), ctx.normalized)
            return handed_to(gx, ctx.grad_target), gw, gb, None, None, None, None, None
        x = unpack_tensor(packed, ctx.storage, ctx.meta)
        if ctx.normalized:  # back to x for torch's kernel (this path decodes a full-size copy anyway)
            chan = (1, -1) + (1,) * (x.dim() - 2)
            x = x.div_(invstd.view(chan)).add_(mean.view(chan))
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad.contiguous(), x, weight, None, None, mean, invstd, True, ctx.eps, mask
        )
        return gx, gw, gb, None, None, None, None, None


class ChunkedBatchNormFunction(StoredBatchNormFunction):
    """``StoredBatchNormFunction`` with native storage (``norm_storage="chunked"``): the input kept as
    it is, exact. Where torch's CPU kernel allocates the input gradient next to the incoming one
    (twice: its contiguous path allocates it again; 98 MiB each at resnet18's stem, b32), the
    chunked backward writes it over the incoming one where this node owns it (``owned_grad``: a
    fresh buffer handed on by the ReLU / max-pool / conv backward after it, read by no one else),
    a few samples at a time once both per-channel sums are taken; the saved input is only read. Same formulas
    as torch's kernel, float32 sums in another order: gradients equal to float rounding. Its own
    node name: coverage reports the input as kept full size."""


def pack_normalized(x: Tensor, mean: Tensor, invstd: Tensor, storage: Storage) -> tuple[Tensor, ...]:
    """(codes, min, scale) of (x - mean) * invstd (per channel) in the integer ``storage``.

    Where samples start on a code group, x_hat is made and packed ``PACK_ELEMENTS`` at a time and
    copied into place, so neither a full-size x_hat nor a second copy of the codes is alive (this
    runs in forward, where resnet18's step peaks); each slice's noise key is the tensor's plus its
    offset, so the codes are those of packing x_hat whole. The fused CPU kernel makes them from x
    in one pass, with no x_hat at all."""
    if _normalizes_fused(x, mean, invstd):
        stochastic = is_stochastic(storage)
        return cpu_kernels.normalize_quantize(x, mean, invstd, BITS[storage], next_key() if stochastic else 0,
                                              stochastic)
    chan = (1, -1) + (1,) * (x.dim() - 2)
    mean, invstd = mean.view(chan), invstd.view(chan)  # float32 for half inputs: so is x_hat

    def x_hat(part: Tensor) -> Tensor:
        return (part - mean).mul_(invstd)

    if torch.compiler.is_compiling() or x.dim() != 4 or not sliceable(tensor_meta(x), storage):
        return pack_tensor(x_hat(x), storage)
    n, per_sample = x.shape[0], x[0].numel()
    codes = torch.empty(x.numel() * BITS[storage] // 8, dtype=torch.uint8, device=x.device)
    lo = torch.empty(x.numel() // GROUP, dtype=torch.float32, device=x.device)
    scale = torch.empty_like(lo)
    key = next_key() if is_stochastic(storage) else 0
    step = max(1, PACK_ELEMENTS // per_sample)
    for s in range(0, n, step):
        part = pack_codes(x_hat(x[s: s + step]), storage, key + s * per_sample)
        for out, piece in zip((codes, lo, scale), part, strict=True):
            at = s * (out.numel() // n)
            out[at: at + piece.numel()].copy_(piece)
    return codes, lo, scale


def _normalizes_fused(x: Tensor, mean: Tensor, invstd: Tensor) -> bool:
    """Whether the fused kernel codes x_hat from this x: eager, 4-d, dense, statistics in x's opmath
    precision (float32, float64 for double)."""
    precision = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.dim() == 4 and is_dense(x) and mean.dtype == invstd.dtype == precision and mean.is_contiguous()
            and invstd.is_contiguous() and cpu_kernels.enabled_for(x))


def _codes_backward_fused(grad: Tensor, meta: TensorMeta, weight: Tensor) -> bool:
    """Whether the fused kernels take the backward passes over x_hat's codes: float32 throughout,
    the gradient laid out as the codes."""
    layout = torch.channels_last if meta.channels_last else torch.contiguous_format
    return (meta.dtype == grad.dtype == weight.dtype == torch.float32 and grad.is_contiguous(memory_format=layout)
            and cpu_kernels.enabled_for(grad))


def chunked_batch_norm_backward(grad: Tensor, packed, storage: Storage, meta: TensorMeta, weight: Tensor,
                                mean: Tensor, invstd: Tensor, mask: list[bool], inplace: bool,
                                normalized: bool = False):
    """(input, weight, bias) gradients of training-mode batch norm from its packed input,
    decoded ``CHUNK_ELEMENTS`` at a time: one pass for the two per-channel sums, one for the
    input gradient, written over ``grad`` when ``inplace``. The formulas of torch's kernel;
    ``normalized``: ``packed`` holds x_hat (``pack_normalized``), not x."""
    n = meta.shape[0]
    count = grad.numel() // grad.shape[1]
    step = max(1, CHUNK_ELEMENTS // max(1, grad[0].numel()))
    chan = (1, -1, 1, 1)
    sum_dy = grad.sum((0, 2, 3), dtype=torch.float32)
    # x_hat = centered * unit: the decoded values minus the mean times invstd, or themselves
    unit = torch.ones_like(invstd) if normalized else invstd

    def centered(s: int) -> Tensor:
        x = unpack_samples(packed, storage, meta, s, min(n, s + step))
        return x if normalized else _centered(x, mean.view(chan), packed)

    # the codes' passes fused (x_hat decoded in cache, each product in the torch ops' order)
    fused = normalized and _codes_backward_fused(grad, meta, weight)
    gx = None if not mask[0] else grad if inplace else torch.empty_like(grad)

    def times_grad(s: int) -> Tensor:
        if not fused:
            return centered(s).mul_(grad[s: s + step])
        part, part_meta = samples_of(packed, storage, meta, s, min(n, s + step))
        # into the input gradient's own buffer where there is one (written anyway: no fresh pages)
        out = (gx[s: s + step] if gx is not None and gx is not grad else
               torch.empty(part_meta.shape, dtype=grad.dtype, memory_format=format_of(grad)))
        return cpu_kernels.norm_codes_times_grad(part, BITS[storage], grad[s: s + step], out)

    dot = torch.zeros_like(sum_dy)  # sum of grad * centered
    for s in range(0, n, step):
        dot += times_grad(s).sum((0, 2, 3), dtype=torch.float32)
    gw = (dot * unit).to(weight.dtype) if mask[1] else None
    gb = sum_dy.to(weight.dtype) if mask[2] else None
    if gx is None:
        return None, gw, gb
    proj = dot * unit * unit / count
    shift = sum_dy / count
    scale = invstd * weight
    for s in range(0, n, step):
        part = gx[s: s + step]
        if fused:
            codes = samples_of(packed, storage, meta, s, min(n, s + step))[0]
            cpu_kernels.norm_codes_input_grad(codes, BITS[storage], grad[s: s + step], proj, shift, scale, part)
            continue
        x = centered(s).mul_(proj.view(chan)).add_(shift.view(chan))
        if inplace:
            part.sub_(x)
        else:
            torch.sub(grad[s: s + step], x, out=part)
        part.mul_(scale.view(chan))
    return gx, gw, gb


def _centered(x: Tensor, mean: Tensor, packed) -> Tensor:
    """x - mean, in place where x is a fresh decoded slice, a new tensor where it is a view of
    the saved input itself (native storage, or a bf16 input kept as bf16)."""
    if x.untyped_storage().data_ptr() == packed[0].untyped_storage().data_ptr():
        return x - mean
    return x.sub_(mean)


def _keeps_batch_stats(module: nn.BatchNorm2d, x: Tensor) -> bool:
    """Training with batch statistics and running ones, affine, and autograd keeping something:
    the case the lessmem BatchNorms take over (else stock's forward)."""
    return module.training and needs_saving(x, module) and module.affine and module.track_running_stats


def _runs_eagerly(x: Tensor) -> bool:
    """Neither traced nor under autocast: where the exact lessmem BatchNorms take over (else stock's
    forward; a compiled graph plans its own buffers, and autocast would save an fp32 copy)."""
    return not torch.compiler.is_compiling() and not torch.is_autocast_enabled(x.device.type)


def _count_batch(module: nn.BatchNorm2d, x: Tensor) -> float:
    """What ``nn.BatchNorm2d.forward`` does before its kernel: check the input, count the batch;
    returns the running statistics' momentum."""
    module._check_input_dim(x)
    module.num_batches_tracked.add_(1)
    return 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum


class NotedBatchNorm2d(nn.BatchNorm2d):
    """Stock BatchNorm2d (the same op, bit for bit on CPU) that notes its saved input and batch
    statistics on its output, so that a ``from_bn`` conv after it and a ReLU rebuilds its input
    from them exactly (to float rounding). ``compress`` swaps it in for the BatchNorms a map with
    ``from_bn`` leaves exact."""

    def forward(self, x: Tensor) -> Tensor:
        if not _keeps_batch_stats(self, x) or not _runs_eagerly(x):
            return super().forward(x)
        momentum = _count_batch(self, x)
        out, mean, invstd = torch.ops.aten.native_batch_norm(
            x, self.weight, self.bias, self.running_mean, self.running_var, True, momentum, self.eps)
        note(out, NormCode((saved_input(out.grad_fn),), "native", tensor_meta(x), False, mean, invstd, self.weight,
                           self.bias))
        return out


class StoredBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that keeps its input in ``lessmem_storage`` (bf16 / int8) — approximate; or, for
    ``CHUNKED``, as it is with the chunked backward (``ChunkedBatchNormFunction``) — exact."""

    lessmem_storage: Storage | str

    def forward(self, x: Tensor) -> Tensor:
        chunked = self.lessmem_storage == CHUNKED
        if not _keeps_batch_stats(self, x) or (chunked and not _runs_eagerly(x)):
            return super().forward(x)
        momentum = _count_batch(self, x)
        x_in = x
        device = x.device.type
        if torch.is_autocast_enabled(device):
            x_in = x.float()  # autocast runs batch norm in fp32
        with torch.autocast(device, enabled=False):
            out = (ChunkedBatchNormFunction if chunked else StoredBatchNormFunction).apply(
                x_in, self.weight, self.bias, self.running_mean, self.running_var,
                momentum, self.eps, "native" if chunked else self.lessmem_storage,
            )
        if not torch.compiler.is_compiling():  # a traced output has no node to read the code from
            note(out, out.grad_fn.code)
        return out
