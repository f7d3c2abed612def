"""Count what autograd keeps alive for backward beyond what the caller holds anyway.

Counted: every tensor that a saved-tensor hook sees during the forward pass, by the bytes it
spans in its storage (first to last element, strides and all); several saved views of one
storage count the union of their byte ranges, once. Not counted: parameters and buffers (the
model holds them), and the model's inputs, i.e. the batch tensors passed in and any view of their
storage: the caller holds them anyway (a training loop keeps its batch until the step ends), so
keeping them for backward costs nothing more. So the figure does not depend on how the batch was
made, a fresh tensor or a slice of a larger one. Under ``compress(..., saved_storage=...)`` the
hooks see the packed parts that stand for a saved tensor (``core.saved_storage`` hands them on),
so those count at their packed size.
"""

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
    layer: str  # innermost module running when the storage was first saved
    shape: tuple[int, ...]  # of the first view saved
    dtype: torch.dtype
    nbytes: int  # union of the byte ranges its saved views span


@dataclass
class MemoryReport:
    """Bytes held for backward after one forward pass (parameters, buffers and the model's inputs
    excluded)."""

    total_bytes: int
    per_layer: dict[str, int]
    tensors: list[SavedTensor] = field(default_factory=list)
    cuda_peak_bytes: int | None = None  # max_memory_allocated over forward + backward (+ step)

    def ratio_to(self, baseline: MemoryReport) -> float:
        return self.total_bytes / baseline.total_bytes if baseline.total_bytes else float("nan")


def storage_key(t: Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def byte_range(t: Tensor) -> tuple[int, int]:
    """[first, last + 1) byte of ``t``'s elements in its storage (empty for no elements)."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def union_bytes(ranges: list[tuple[int, int]]) -> int:
    """Bytes covered by the union of [start, end) ranges."""
    total, reached = 0, 0
    for start, end in sorted(ranges):
        start = max(start, reached)  # the part before ``reached`` is counted already
        if end > start:
            total += end - start
            reached = end
    return total


def output_tensor(out: object) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    if isinstance(out, dict):
        return next(v for v in out.values() if isinstance(v, Tensor))
    raise TypeError(f"cannot find a tensor in the model output of type {type(out).__name__}")


def graph_free(t: Tensor) -> Tensor:
    """``t`` as a pack hook may keep it: detached where it has a grad_fn. An op's output kept with
    its own grad_fn (or a hook object that keeps it, stored in the graph) forms a cycle through
    C++ that no gc breaks, and a forward that never runs backward leaks its whole graph. Autograd
    restores the grad_fn on unpack; a tensor without one (a packed copy) is kept as it is."""
    return t if t.grad_fn is None else t.detach()


def saved_tensors_of(model: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[list[SavedTensor], object]:
    """Run ``model(*inputs)`` and record each storage autograd saves (by the byte ranges its saved
    views span), with the innermost module that was executing when it was first saved. The
    model's parameters, buffers and inputs are not recorded. Returns (records, the output)."""
    held = itertools.chain(model.parameters(), model.buffers(), (t for t in inputs if isinstance(t, Tensor)))
    excluded = {storage_key(t) for t in held}
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
    ranges: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    keep_alive: list[Tensor] = []  # ensures no storage address is reused while we count

    def pack(t: Tensor) -> Tensor:
        if t.layout == torch.strided and t.device.type != "meta":
            key = storage_key(t)
            if key not in excluded and key[1] != 0:
                ranges[key].append(byte_range(t))
                if key not in records:
                    records[key] = SavedTensor(key, stack[-1], tuple(t.shape), t.dtype, 0)
                    keep_alive.append(graph_free(t))
                records[key].nbytes = union_bytes(ranges[key])
        return graph_free(t)  # this forward runs no backward to release a cycle

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
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

    What is counted (see the module docstring): the byte ranges of every saved tensor, each byte
    of a storage once even when several layers save views of it, attributed to the layer that
    saved the storage first; parameters, buffers and ``inputs`` (and views of them) excluded.
    On CUDA also ``torch.cuda.max_memory_allocated`` over forward + backward (``train_step``),
    measured in a second pass so the counting hooks do not distort it.
    """
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    records, out = saved_tensors_of(model, args)
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
        loss_fn(output_tensor(model(*args))).backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated()
