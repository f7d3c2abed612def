"""BatchNorm with a lower-precision copy of its input (approximate, opt-in): the autograd Function,
its chunked backward, and the swapped-in ``StoredBatchNorm2d``.

Integer codes keep the *normalized* input x_hat = (x - mean) * invstd, not x: a code group spans
several channels (memory order), and in x a low-variance channel gets a few levels of a range set
by the widest one, an error that normalization then multiplies by 1 / std. In x_hat every channel
has unit variance. On a trained resnet20 (every BatchNorm input int2, the rest exact) that halves
the whole gradient's squared error (0.029 -> 0.015; int1 0.31 -> 0.17) at the same bytes. bf16 keeps
x (its error is relative to each value already)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lessmem.core.ops.dispatch import needs_saving
from lessmem.core.ops.input_notes import NormCode, note, refs, saved_input
from lessmem.core.ops.owned_grad import grad_target, handed_to, owns
from lessmem.core.rounding import next_key
from lessmem.core.storage import (
    BITS,
    GROUP,
    Storage,
    TensorMeta,
    is_stochastic,
    pack_codes,
    pack_tensor,
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


def pack_normalized(x: Tensor, mean: Tensor, invstd: Tensor, storage: Storage) -> tuple[Tensor, ...]:
    """(codes, min, scale) of (x - mean) * invstd (per channel) in the integer ``storage``.

    Where samples start on a code group, x_hat is made and packed ``PACK_ELEMENTS`` at a time and
    copied into place, so neither a full-size x_hat nor a second copy of the codes is alive (this
    runs in forward, where resnet18's step peaks); each slice's noise key is the tensor's plus its
    offset, so the codes are those of packing x_hat whole."""
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

    dot = torch.zeros_like(sum_dy)  # sum of grad * centered
    for s in range(0, n, step):
        dot += (centered(s).mul_(grad[s: s + step])).sum((0, 2, 3), dtype=torch.float32)
    gw = (dot * unit).to(weight.dtype) if mask[1] else None
    gb = sum_dy.to(weight.dtype) if mask[2] else None
    if not mask[0]:
        return None, gw, gb
    proj = (dot * unit * unit / count).view(chan)
    shift = (sum_dy / count).view(chan)
    scale = (invstd * weight).view(chan)
    gx = grad if inplace else torch.empty_like(grad)
    for s in range(0, n, step):
        x = centered(s).mul_(proj).add_(shift)
        part = gx[s: s + step]
        if inplace:
            part.sub_(x)
        else:
            torch.sub(grad[s: s + step], x, out=part)
        part.mul_(scale)
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
        if not _keeps_batch_stats(self, x) or torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        momentum = _count_batch(self, x)
        out, mean, invstd = torch.ops.aten.native_batch_norm(
            x, self.weight, self.bias, self.running_mean, self.running_var, True, momentum, self.eps)
        note(out, NormCode((saved_input(out.grad_fn),), "native", tensor_meta(x), False, mean, invstd, self.weight,
                           self.bias))
        return out


class StoredBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that keeps its input in ``lessmem_storage`` (bf16 / int8) — approximate."""

    lessmem_storage: Storage

    def forward(self, x: Tensor) -> Tensor:
        if not _keeps_batch_stats(self, x):
            return super().forward(x)
        momentum = _count_batch(self, x)
        x_in = x
        device = x.device.type
        if torch.is_autocast_enabled(device):
            x_in = x.float()  # autocast runs batch norm in fp32
        with torch.autocast(device, enabled=False):
            out = StoredBatchNormFunction.apply(
                x_in, self.weight, self.bias, self.running_mean, self.running_var,
                momentum, self.eps, self.lessmem_storage,
            )
        if not torch.compiler.is_compiling():  # a traced output has no node to read the code from
            note(out, out.grad_fn.code)
        return out
