"""Layer sensitivity to compressed activations, from ONE stock forward/backward per batch.

Hooks (``recorder``) capture every conv's (and token linear's) input and output gradient, and each
layer x kernel costs one extra weight-gradient computation. Since the input gradients stay exact, per-layer
fidelities compose: the fidelity of any per-layer map is the per-layer fidelity of its kernels,
with no further backward passes (used by ``lessmem.search``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.sensitivity.geometry import SensitivityLayer, sensitivity_layers
from lessmem.sensitivity.recorder import GradientRecorder
from lessmem.sensitivity.result import SensitivityResult

DEFAULT_KERNELS = (1, 2, 4, 8)
Batch = Tensor | tuple[Tensor, Tensor] | list[Tensor]


def sensitivity(
    model: nn.Module,
    batches: Iterable[Batch],
    kernels: Sequence[int] = DEFAULT_KERNELS,
    loss_fn: Callable[[Tensor, Tensor | None], Tensor] | None = None,
    *,
    progress: bool = False,
    restore_buffers: bool = True,
) -> SensitivityResult:
    """Weight-gradient fidelity of every Conv2d (kernel k: k x k blocks) and every linear on token
    inputs (k consecutive tokens) for each pooling kernel, one backward per batch.

    batches: ``inputs`` or ``(inputs, targets)``; moved to the model's device.
    loss_fn(output, targets): cross-entropy by default (mean square of the output without
    targets); pass the training loss for other outputs (a language model's next-token loss).
    The model runs in its current mode (use ``model.train()`` for training-mode BN statistics).
    restore_buffers: put BN running statistics back afterwards, so the probe leaves no trace.
    Assumes the rest of the backward is exact (stock model, or compressed with exact companions
    and native norm storage), which is what makes a single stock pass sufficient.
    """
    kernels = sorted({int(k) for k in kernels})
    if not kernels or kernels[0] < 1:
        raise ValueError(f"kernels must be positive integers, got {kernels}")
    layers = sensitivity_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no trainable Conv2d or token linear layer")
    loss_fn = loss_fn or _default_loss
    rec = GradientRecorder(layers, kernels)
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    saved = {k: v.detach().clone() for k, v in model.named_buffers()} if restore_buffers else {}
    handles = [layer.module.register_forward_hook(rec.forward_hook(layer)) for layer in layers]
    n_batches = 0
    try:
        for batch in _progress(batches, progress):
            x, y = _split(batch)
            out = model(x.to(device))
            loss = loss_fn(out, None if y is None else y.to(device))
            # autograd.grad, not .backward(): no .grad is touched, so this can run mid-training.
            torch.autograd.grad(loss, params, allow_unused=True)
            rec.drop_inputs()
            n_batches += 1
    finally:
        for h in handles:
            h.remove()
        if saved:
            with torch.no_grad():
                for k, v in model.named_buffers():
                    v.copy_(saved[k])
    if n_batches == 0:
        raise ValueError("sensitivity got no batches")
    return _collect(rec, layers, kernels, n_batches)


def _split(batch: Batch) -> tuple[Tensor, Tensor | None]:
    if isinstance(batch, (tuple, list)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    return batch, None


def _default_loss(out: Tensor, target: Tensor | None) -> Tensor:
    if target is None:  # no labels: any scalar works for fidelity; this one is label-free
        return out.float().square().mean()
    return F.cross_entropy(out, target)


def _progress(batches: Iterable[Batch], enabled: bool) -> Iterable[Batch]:
    if not enabled:
        return batches
    from tqdm.auto import tqdm

    return tqdm(batches, desc="sensitivity", unit="batch", total=getattr(batches, "__len__", lambda: None)())


def _collect(rec: GradientRecorder, layers: list[SensitivityLayer], kernels: list[int], n_batches: int) -> SensitivityResult:
    names = [layer.name for layer in layers if f"{layer.name}/{kernels[0]}" in rec.stats]
    if not names:
        raise ValueError("sensitivity measured no layer: no Conv2d and no linear on (..., tokens, features) "
                         "inputs had a gradient reach it")
    shape = (len(names), len(kernels))
    stats = {key: np.zeros(shape) for key in ("cm", "cs", "rm", "rs")}
    nbytes = np.zeros(shape, dtype=np.int64)
    for i, name in enumerate(names):
        for j, k in enumerate(kernels):
            vals = np.asarray(rec.stats[f"{name}/{k}"])
            stats["cm"][i, j], stats["cs"][i, j] = vals[:, 0].mean(), vals[:, 0].std()
            stats["rm"][i, j], stats["rs"][i, j] = vals[:, 1].mean(), vals[:, 1].std()
            nbytes[i, j] = rec.pooled_bytes(name, k)
    group_ids: dict[tuple[int, tuple[int, ...], str], int] = {}
    groups = [group_ids.setdefault(rec.groups[n], len(group_ids)) for n in names]
    return SensitivityResult(names, kernels, stats["cm"], stats["cs"], stats["rm"], stats["rs"], nbytes,
                             [list(rec.shapes[n]) for n in names], groups, n_batches)
