"""Transformer layers with compressed saved tensors: attention, dropout, GELU / SiLU.

What a pre-norm transformer block (torchvision ``EncoderBlock``) keeps for backward, per token,
in units of the width E (MLP width 4E), and what ``compress`` does to it:

==========================  =========  ==========================================================
tensor                      stock      lessmem
==========================  =========  ==========================================================
LayerNorm inputs (×2)       2E         full size: exact LayerNorm backward needs its input
in-projection input         E          pooled over k tokens (E/k), for the weight gradient only
q, k, v (one storage)       3E         full size: exact attention backward needs them
attention output            E          full size: kept by SDPA; the out-projection's input is a
                                       view of it, so an exact out-projection costs nothing more
attention matrix            0          never kept (``F.scaled_dot_product_attention``)
MLP fc1 input               E          pooled (E/k)
GELU / SiLU input           4E         full size (exact); bf16 / int8 with ``act_storage`` —
                                       approximate input gradient, opt-in
MLP fc2 input (GELU out)    4E         pooled (4E/k)
dropout (p > 0)             4 B/elem   1 bit per element (``PackedDropout``), exact
residual adds               0          0: an add needs nothing for backward
==========================  =========  ==========================================================

So pooling attacks ~6E of ~17E per block; the rest is kept because the input gradient must stay
exact (LayerNorm, attention, GELU) — only GELU has an explicit lossy option.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core.modules import LayerSpec, _autocast_cast, _needs_saving
from lessmem.core.ops import PooledLinearFunction, pack_bits, unpack_bits
from lessmem.core.storage import Storage, pack_tensor, unpack_tensor

# ---------------------------------------------------------------------------------------------
# Multi-head attention
# ---------------------------------------------------------------------------------------------


class CompressedMultiheadAttention(nn.MultiheadAttention):
    """Self-attention whose in-projection saves its input pooled over ``k`` tokens.

    Same parameters (``in_proj_weight``, ``out_proj.weight``, ...) as the stock module, so
    ``state_dict`` keys do not change. Handled: self-attention (``query is key is value``),
    batched 3-D inputs, ``batch_first`` either way, packed in-projection, no masks,
    ``need_weights=False``. Anything else runs the stock forward unchanged.

    ``pool_out_proj`` (default False): the out-projection's input is a view of the attention
    output that SDPA keeps anyway, so the exact out-projection costs no extra bytes, whereas a
    pooled one would add an E/k copy. Set it True to pool it regardless (measurement, ablation).
    """

    lessmem_spec: LayerSpec
    pool_out_proj: bool = False

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        supported = (
            query is key
            and key is value
            and query.dim() == 3
            and key_padding_mask is None
            and attn_mask is None
            and not is_causal  # stock requires a mask alongside is_causal anyway
            and not need_weights
            and self._qkv_same_embed_dim
            and self.bias_k is None
            and self.bias_v is None
            and not self.add_zero_attn
            and _needs_saving(query, self)
        )
        if not supported:
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask,
                average_attn_weights, is_causal,
            )
        return self._pooled_self_attention(query), None

    def _pooled_self_attention(self, x: Tensor) -> Tensor:
        k, storage = self.lessmem_spec.kernel[0], self.lessmem_spec.storage
        if not self.batch_first:
            x = x.transpose(0, 1)  # (B, T, E) view: tokens must be dim -2 for token pooling
        b, t, e = x.shape
        heads = self.num_heads
        x, w, bias = _autocast_cast(x, self.in_proj_weight, self.in_proj_bias)
        with torch.autocast(x.device.type, enabled=False):
            qkv = PooledLinearFunction.apply(x, w, bias, k, storage)
        # q, k, v as strided views of the one (B, T, 3E) projection: SDPA saves that storage
        # once instead of three contiguous copies.
        qkv = qkv.view(b, t, 3, heads, e // heads)
        q, k_, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k_, v, dropout_p=dropout)
        out = out.transpose(1, 2).reshape(b, t, e)  # a view when SDPA's output is (B, T, H, d)
        if self.pool_out_proj:
            out, w, bias = _autocast_cast(out, self.out_proj.weight, self.out_proj.bias)
            with torch.autocast(out.device.type, enabled=False):
                out = PooledLinearFunction.apply(out, w, bias, k, storage)
        else:
            out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        return out if self.batch_first else out.transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# Dropout with a 1-bit mask (exact)
# ---------------------------------------------------------------------------------------------


class PackedDropoutFunction(torch.autograd.Function):
    """Dropout that keeps its keep-mask as bits, not the fp32 noise tensor stock CPU autograd
    keeps. The random draws and arithmetic repeat stock's, so outputs and gradients are
    bit-identical to ``nn.Dropout`` under the same RNG state."""

    @staticmethod
    def forward(ctx, x, p):
        if x.device.type == "cpu":
            # aten::_dropout_impl on CPU: noise = bernoulli(1 - p) / (1 - p); out = x * noise.
            noise = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
            out = x * noise
            keep = noise != 0
        else:
            # Accelerators use the fused kernel, with the same (output, bool mask) contract.
            out, keep = torch.ops.aten.native_dropout(x, p, True)
        ctx.save_for_backward(pack_bits(keep))
        ctx.shape, ctx.p = keep.shape, p
        return out

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        keep = unpack_bits(packed, ctx.shape)
        if grad.device.type == "cpu":
            # Rebuild the noise values exactly as forward made them (same ops, same rounding).
            scale = grad.new_ones(()).div_(1 - ctx.p)
            return grad * torch.where(keep, scale, grad.new_zeros(())), None
        return torch.ops.aten.native_dropout_backward(grad, keep, 1.0 / (1 - ctx.p)), None


class PackedDropout(nn.Dropout):
    """nn.Dropout that keeps 1 bit per element for backward (exact)."""

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and 0.0 < self.p < 1.0 and not self.inplace and _needs_saving(x, self)):
            return super().forward(x)
        return PackedDropoutFunction.apply(x, self.p)


# ---------------------------------------------------------------------------------------------
# GELU / SiLU with a lower-precision copy of the input (approximate, opt-in)
# ---------------------------------------------------------------------------------------------


class StoredActivationFunction(torch.autograd.Function):
    """GELU or SiLU that keeps its input as bf16 or 8-bit per-feature codes.

    Approximate: the derivative is evaluated at the dequantized input, so the input gradient is
    no longer exact. Opt-in through ``compress(..., act_storage=...)``.
    """

    @staticmethod
    def forward(ctx, x, kind, approximate, storage):
        out = F.gelu(x, approximate=approximate) if kind == "gelu" else F.silu(x)
        ctx.save_for_backward(*pack_tensor(x.detach(), storage))
        ctx.kind, ctx.approximate, ctx.storage, ctx.dtype = kind, approximate, storage, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x = unpack_tensor(ctx.saved_tensors, ctx.storage, ctx.dtype)
        if ctx.kind == "gelu":
            gx = torch.ops.aten.gelu_backward(grad, x, approximate=ctx.approximate)
        else:
            gx = torch.ops.aten.silu_backward(grad, x)
        return gx, None, None, None


class StoredGELU(nn.GELU):
    """GELU keeping its input in ``lessmem_storage`` (bf16 / int8) — approximate."""

    lessmem_storage: Storage

    def forward(self, x: Tensor) -> Tensor:
        if not _needs_saving(x, self):
            return super().forward(x)
        return StoredActivationFunction.apply(x, "gelu", self.approximate, self.lessmem_storage)


class StoredSiLU(nn.SiLU):
    """SiLU keeping its input in ``lessmem_storage`` (bf16 / int8) — approximate."""

    lessmem_storage: Storage

    def forward(self, x: Tensor) -> Tensor:
        if not _needs_saving(x, self) or self.inplace:
            return super().forward(x)
        return StoredActivationFunction.apply(x, "silu", "none", self.lessmem_storage)


STORED_ACTIVATIONS: dict[type[nn.Module], type[nn.Module]] = {
    nn.GELU: StoredGELU,
    nn.SiLU: StoredSiLU,
}
