"""HF transformers' ``Conv1D`` (GPT-2's projections: a linear whose weight is stored (in, out),
y = x @ W + b) saving its input pooled over groups of k tokens."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lessmem.core.layers.linear import keeps_stock_path, token_pooled_linear
from lessmem.core.spec import LayerSpec


class CompressedTransposedLinear(nn.Module):
    """Swapped in for ``transformers.pytorch_utils.Conv1D`` (matched by name: the core does not
    import transformers); it keeps that class's ``weight`` (in, out), ``bias`` and ``nf``."""

    lessmem_spec: LayerSpec
    weight: nn.Parameter
    bias: nn.Parameter
    nf: int

    def forward(self, x: Tensor) -> Tensor:
        if keeps_stock_path(self, x):  # Conv1D's own forward, bit for bit
            out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
            return out.view(*x.shape[:-1], self.nf)
        return token_pooled_linear(self, x, self.weight.t(), self.bias)
