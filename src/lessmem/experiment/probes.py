"""Measurements on a model during a run: saved-for-backward bytes, gradient fidelity of the
compressed layers, validation metrics (the task's), fixed probe batches."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core import compressed_layers, measure_memory, measure_step_memory, uncompress
from lessmem.experiment.distributed import all_reduce_mean_, all_reduce_sum
from lessmem.experiment.runtime import PRECISIONS, autocast
from lessmem.experiment.task import Task


def first_batch(loader: Any, n: int) -> tuple[Tensor, Tensor]:
    """The first ``n`` (inputs, targets) of a loader: a fixed probe batch."""
    xs, ys, have = [], [], 0
    for x, y in loader:
        xs.append(x)
        ys.append(y)
        have += len(y)
        if have >= n:
            break
    return torch.cat(xs)[:n], torch.cat(ys)[:n]


def measure(stock: nn.Module, model: nn.Module | None, batch: tuple[Tensor, Tensor], device: torch.device,
            precision: str, make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
            loss_fn: Callable[[Tensor, Tensor], Tensor]) -> dict[str, Any]:
    """Saved-for-backward bytes and whole-step peak memory (forward, backward, optimizer step)
    of the stock and the compressed model on one batch, the step's loss ``loss_fn``. Runs on
    copies in train mode so the weights, BatchNorm statistics and RNG of the real model are
    untouched. ``model`` None: the run is stock, measured once (its ratios are exactly 1)."""
    x, y = batch
    out: dict[str, Any] = {"memory_batch": len(x)}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        measured = {}
        for prefix, net in (("stock_", stock), ("", model)):
            if net is None:
                measured[prefix] = measured["stock_"]
                continue
            net = copy.deepcopy(net).to(device).train()
            with autocast(device, precision):
                report = measure_memory(net, x.to(device))
            # live=False: the record keeps the peak and its categories, not the tensors named at it
            step = measure_step_memory(net, (x.to(device), y.to(device)), optimizer=make_optimizer(net),
                                       loss_fn=loss_fn, amp_dtype=PRECISIONS[precision], live=False)
            measured[prefix] = (report, step)
            del net
    for prefix, (report, step) in measured.items():
        out[f"{prefix}saved_bytes"] = report.total_bytes
        out[f"{prefix}cuda_peak_bytes"] = report.cuda_peak_bytes
        out[f"{prefix}step_peak_bytes"] = step.peak_bytes
    report, step = measured[""]
    out["saved_bytes_per_layer"] = report.per_layer
    out["step_peak_phase"] = step.phase
    out["step_peak_by_category"] = step.by_category
    out["ratio"] = out["saved_bytes"] / out["stock_saved_bytes"] if out["stock_saved_bytes"] else float("nan")
    out["step_peak_ratio"] = out["step_peak_bytes"] / out["stock_step_peak_bytes"]
    return out


def grad_cosine(model: nn.Module, x: Tensor, y: Tensor, criterion: Callable[[Tensor, Tensor], Tensor],
                device: torch.device,
                precision: str) -> dict[str, float]:
    """Cosine(exact weight grad, compressed weight grad) per compressed layer, on the batch whose
    compressed grads are in ``model`` now. The exact grads come from an uncompressed copy
    (forward is exact, so both see identical activations); scale-invariant, so GradScaler is fine."""
    layers = compressed_layers(model)
    if not layers:
        return {}
    grads = {n: model.get_submodule(n).weight.grad for n in layers}
    exact = copy.deepcopy(model)
    uncompress(exact)
    exact.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast(device, precision):
            loss = criterion(exact(x), y)
        loss.backward()
    out = {}
    for name, g in grads.items():
        ge = exact.get_submodule(name).weight.grad
        if ge is not None:  # DDP averaged the compressed grads over the ranks: so do these
            all_reduce_mean_(ge)
        if g is not None and ge is not None:
            out[name] = F.cosine_similarity(g.flatten().float(), ge.flatten().float(), dim=0).item()
    return out


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, task: Task, device: torch.device,
             precision: str) -> dict[str, float]:
    """The task's validation metrics (``val_loss`` and ``val_top1`` / ``val_ppl`` ...) over ``loader``."""
    model.eval()
    sums = dict.fromkeys(task.eval_keys, 0.0)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, precision):
            logits = model(x)
        for key, value in task.eval_sums(logits, y).items():
            sums[key] += value
    return task.eval_record(dict(zip(sums, all_reduce_sum(list(sums.values()), device), strict=True)))  # shards
