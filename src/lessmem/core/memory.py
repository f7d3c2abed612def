"""Count what autograd keeps for backward: unique storages of every saved tensor."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass
class SavedTensor:
    key: tuple[str, int]  # (device, storage address): one record per storage
    layer: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass
class MemoryReport:
    """Bytes held for backward after one forward pass (parameters and buffers excluded)."""

    total_bytes: int
    per_layer: dict[str, int]
    tensors: list[SavedTensor] = field(default_factory=list)
    cuda_peak_bytes: int | None = None  # max_memory_allocated over forward + backward (+ step)

    @property
    def total_mib(self) -> float:
        return self.total_bytes / 2**20

    def ratio_to(self, baseline: MemoryReport) -> float:
        return self.total_bytes / baseline.total_bytes if baseline.total_bytes else float("nan")

    def as_dict(self) -> dict[str, object]:
        return {
            "saved_bytes": self.total_bytes,
            "saved_mib": self.total_mib,
            "cuda_peak_bytes": self.cuda_peak_bytes,
            "per_layer": dict(self.per_layer),
        }


def _storage_key(t: Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _output_tensor(out: object) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    if isinstance(out, dict):
        return next(v for v in out.values() if isinstance(v, Tensor))
    raise TypeError(f"cannot find a tensor in the model output of type {type(out).__name__}")


def saved_tensors_of(model: nn.Module, run: Callable[[], object]) -> tuple[list[SavedTensor], object]:
    """Run ``run()`` (a forward pass) and record each unique storage autograd saves, with the
    innermost module that was executing when it was saved. Returns (records, run's output)."""
    excluded = {_storage_key(t) for t in itertools.chain(model.parameters(), model.buffers())}
    stack: list[str] = [""]
    handles = []

    def enter(name: str) -> Callable[..., None]:
        return lambda module, args: stack.append(name)

    def leave(module: nn.Module, args: object, output: object) -> None:
        stack.pop()  # a hook's non-None return would replace the output

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    records: dict[tuple[str, int], SavedTensor] = {}
    keep_alive: list[Tensor] = []  # ensures no storage address is reused while we count

    def pack(t: Tensor) -> Tensor:
        if t.layout == torch.strided and t.device.type != "meta":
            key = _storage_key(t)
            if key not in excluded and key not in records and key[1] != 0:
                nbytes = t.untyped_storage().nbytes()
                records[key] = SavedTensor(key, stack[-1], tuple(t.shape), t.dtype, nbytes)
                keep_alive.append(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
    finally:
        for h in handles:
            h.remove()
    return list(records.values()), out


def measure_memory(
    model: nn.Module,
    inputs: Tensor | tuple[Tensor, ...],
    *,
    loss_fn: Callable[[Tensor], Tensor] | None = None,
    train_step: bool = True,
) -> MemoryReport:
    """Bytes held for backward after ``model(inputs)``, per layer and in total.

    Each storage is counted once, at its full size, even when several layers save views of it.
    On CUDA also ``torch.cuda.max_memory_allocated`` over forward + backward (``train_step``),
    measured in a second pass so the counting hooks do not distort it.
    """
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    records, out = saved_tensors_of(model, lambda: model(*args))
    per_layer: dict[str, int] = defaultdict(int)
    for r in records:
        per_layer[r.layer] += r.nbytes
    del out
    report = MemoryReport(sum(r.nbytes for r in records), dict(per_layer), records)
    device = args[0].device
    if device.type == "cuda" and train_step:
        report.cuda_peak_bytes = cuda_peak_of_step(model, args, loss_fn)
    return report


def cuda_peak_of_step(
    model: nn.Module, args: tuple[Tensor, ...], loss_fn: Callable[[Tensor], Tensor] | None = None
) -> int:
    """Peak allocated CUDA bytes of one forward + backward, after a warm-up step."""
    loss_fn = loss_fn or (lambda y: y.float().square().mean())
    for warm in (True, False):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if not warm:
            torch.cuda.reset_peak_memory_stats()
        loss_fn(_output_tensor(model(*args))).backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated()
