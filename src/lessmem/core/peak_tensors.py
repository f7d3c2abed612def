"""The tensors alive at a profiled step's peak, each named by the op and the Python line that
allocated it: what ``StepMemoryReport.live`` lists, so a peak can be read tensor by tensor."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from torch._C._profiler import _EventType
from torch.profiler._memory_profiler import Action, MemoryProfile, TensorKey


@dataclass(frozen=True)
class LiveTensor:
    """One allocation alive at the peak."""

    nbytes: int
    category: str
    op: str  # innermost aten op running when it was allocated ("" outside any)
    source: str  # innermost Python frame of lessmem or a model / torch.nn module, "" if none


def live_at_peak(memory_profile: MemoryProfile, device: torch.device, peak_time: int,
                 category_of) -> list[LiveTensor]:
    """Replay the timeline up to ``peak_time`` (inclusive) and name what is still alive, largest
    first. ``category_of(key, version)`` is the report's category name. Allocations the profiler
    could not tie to a tensor are matched to their free by size."""
    live: dict[tuple, tuple[int, int, str]] = {}
    unknown: dict[int, list[tuple[int, str]]] = {}
    for time, action, (key, version), nbytes in memory_profile.timeline:
        if key.device != device or time > peak_time:
            continue
        if not isinstance(key, TensorKey):
            if action == Action.CREATE:
                unknown.setdefault(nbytes, []).append((time, "unknown"))
            elif action == Action.DESTROY and unknown.get(nbytes):
                unknown[nbytes].pop()
            continue
        if action in (Action.PREEXISTING, Action.CREATE):
            live[(key, version)] = (nbytes, time, category_of(key, version))
        elif action == Action.INCREMENT_VERSION:
            size, created, _ = live.pop((key, version), (nbytes, time, ""))
            live[(key, version + 1)] = (size, created, category_of(key, version + 1))
        else:
            live.pop((key, version), None)
    allocations = [v for v in live.values()] + [
        (size, time, cat) for size, entries in unknown.items() for time, cat in entries]
    ops, frames = _intervals(memory_profile)
    return sorted((LiveTensor(size, cat, _innermost(ops, t), _innermost(frames, t))
                   for size, t, cat in allocations if size > 0), key=lambda x: -x.nbytes)


def _intervals(memory_profile: MemoryProfile):
    """(aten ops, Python frames worth naming) as start-sorted lists of (start, end, name)."""
    ops, frames = [], []
    for event in memory_profile._op_tree.dfs():
        kind = event.typed[0]
        if kind == _EventType.TorchOp:
            ops.append((event.start_time_ns, event.end_time_ns, event.name))
        elif kind == _EventType.PyCall and ("lessmem" in event.name or "torch/nn/modules" in event.name):
            frames.append((event.start_time_ns, event.end_time_ns, _short(event.name)))
    return sorted(ops), sorted(frames)


def _short(name: str) -> str:
    return name.split("src/")[-1].split("site-packages/")[-1]


def _innermost(intervals: list[tuple[int, int, str]], time: int) -> str:
    """The latest-starting interval that covers ``time`` (the innermost, as calls nest)."""
    i = bisect.bisect_right(intervals, (time, float("inf"), ""))
    for start, end, name in reversed(intervals[max(0, i - 400):i]):
        if start <= time <= end:
            return name
    return ""


def format_live(live: list[LiveTensor], min_bytes: int = 2**20) -> str:
    """A markdown table of the live tensors of at least ``min_bytes``, and one row for the rest."""
    rows = ["| MiB | category | allocated in op | at |", "|---|---|---|---|"]
    small = 0
    for t in live:
        if t.nbytes < min_bytes:
            small += t.nbytes
            continue
        rows.append(f"| {t.nbytes / 2**20:.1f} | {t.category} | {t.op} | {t.source} |")
    rows.append(f"| {small / 2**20:.1f} | (all smaller tensors) | | |")
    return "\n".join(rows)
