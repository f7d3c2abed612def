"""Self-attention whose in-projection saves its input pooled over k tokens.

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

from lessmem.core.ops.dispatch import autocast_cast, needs_saving
from lessmem.core.ops.linear import PooledLinearFunction
from lessmem.core.spec import LayerSpec


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
            and needs_saving(query, self)
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
        x, w, bias = autocast_cast(x, self.in_proj_weight, self.in_proj_bias)
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
            out, w, bias = autocast_cast(out, self.out_proj.weight, self.out_proj.bias)
            with torch.autocast(out.device.type, enabled=False):
                out = PooledLinearFunction.apply(out, w, bias, k, storage)
        else:
            out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
        return out if self.batch_first else out.transpose(0, 1)
