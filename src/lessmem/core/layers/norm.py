"""BatchNorm2d that keeps its input in bf16 or int8 (approximate, opt-in)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lessmem.core.functions.batchnorm import StoredBatchNormFunction
from lessmem.core.layers.dispatch import needs_saving
from lessmem.core.storage import Storage


class StoredBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d that keeps its input in ``lessmem_storage`` (bf16 / int8) — approximate."""

    lessmem_storage: Storage

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and needs_saving(x, self) and self.affine and self.track_running_stats):
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
