"""Peak memory of one whole training step (forward, backward, optimizer step), split by what
the bytes hold: parameters, gradients, optimizer state, activations, temporaries.

On every device the split comes from torch's memory profiler: it records each tensor
allocation and free of the step, ties each storage to a category from the step's data flow,
and we replay that timeline to find its peak. On the CPU that replay is also the peak: bytes of
tensor allocations through torch's CPU allocator (not the process's resident memory; see
``peak_rss_growth`` below for that cross-check). On CUDA the peak is
``torch.cuda.max_memory_allocated`` over the step, which also counts whatever else lives on the
device.

The categorizer is torch's private ``torch.profiler._memory_profiler`` (the engine behind the
public, deprecated ``profile.export_memory_timeline``), pinned with the torch version.
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.profiler._memory_profiler import Action, Category, MemoryProfile, TensorKey

from lessmem.core.peak_tensors import LiveTensor, live_at_peak

# torch's categories under the names the report uses. "autograd_detail": tensors made in the
# backward pass that are not parameter gradients (the gradients of activations in flight);
# "unknown": bytes it could not tie to a role (scratch buffers, tensors that only C++ kernels
# outside the dispatcher write).
CATEGORY_NAMES: dict[Category | None, str] = {
    Category.PARAMETER: "parameters",
    Category.OPTIMIZER_STATE: "optimizer_state",
    Category.GRADIENT: "gradients",
    Category.ACTIVATION: "activations",
    Category.AUTOGRAD_DETAIL: "autograd_detail",
    Category.TEMPORARY: "temporaries",
    Category.INPUT: "inputs",
    None: "unknown",
}

_PHASE_LABEL = "lessmem.step."  # record_function names that mark the phases of training_step


@dataclass
class StepMemoryReport:
    """Live bytes at the peak of one training step, and how they split by category."""

    peak_bytes: int
    by_category: dict[str, int]  # live bytes per category at the profiled peak
    start_bytes: int  # live before the step: parameters, buffers, optimizer state, the batch
    phase: str | None  # training_step's phase at the profiled peak; None for other steps
    device: str
    method: str  # what peak_bytes reads
    live: list[LiveTensor] = field(default_factory=list)  # alive at the profiled peak, largest first

    def ratio_to(self, baseline: StepMemoryReport) -> float:
        return self.peak_bytes / baseline.peak_bytes if baseline.peak_bytes else float("nan")


@dataclass
class StepMemoryTracker:
    """Filled in when its ``track_step_memory`` block ends."""

    report: StepMemoryReport | None = None


def training_step(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    amp_dtype: torch.dtype | None = None,
) -> Tensor:
    """One step: clear the gradients, forward (under autocast to ``amp_dtype`` if given),
    backward, ``optimizer.step()`` (skipped without an optimizer). Returns the loss."""
    inputs, targets = batch
    model.zero_grad(set_to_none=True)
    amp = torch.autocast(inputs.device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
    with record_function(_PHASE_LABEL + "forward"), amp:
        loss = loss_fn(model(inputs), targets)
    with record_function(_PHASE_LABEL + "backward"):
        loss.backward()
    if optimizer is not None:
        with record_function(_PHASE_LABEL + "optimizer_step"):
            optimizer.step()
    return loss.detach()


def alternating_step_times(steps: Sequence[Callable[[], object]], repeats: int, *, warmup: int = 1,
                           clock: Callable[[], float] = perf_counter, device: torch.device | None = None,
                           before: Sequence[Callable[[], object]] | None = None) -> list[list[float]]:
    """Each of ``steps`` (callables running one training step) timed ``repeats`` times, taking turns
    after ``warmup`` untimed rounds: a shared machine's noise hits every one alike, and the ratio of
    their medians is the figure to read. ``before[k]`` runs untimed before each call of ``steps[k]``
    (one model recompressed between plans); on a CUDA ``device`` each step is synchronized around."""
    cuda = device is not None and device.type == "cuda"
    times: list[list[float]] = [[] for _ in steps]
    for i in range(warmup + repeats):
        for k, step in enumerate(steps):
            if before is not None:
                before[k]()
            if cuda:
                torch.cuda.synchronize(device)
            start = clock()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[k].append(clock() - start)
    return times


def measure_step_memory(
    model: nn.Module,
    batch: tuple[Tensor, Tensor],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    amp_dtype: torch.dtype | None = None,
    warmup_steps: int = 1,
    live: bool = True,
) -> StepMemoryReport:
    """Peak memory of one ``training_step`` on ``batch`` = (inputs, targets), after
    ``warmup_steps`` unmeasured ones (they create the optimizer state and build lazy kernels).

    The steps are real: they update the parameters, buffers and optimizer state; measure a
    copy when those matter. Gradients are cleared before the measured step, as a training loop
    that clears them at the start of each step has them. ``live=False`` leaves ``report.live``
    empty (naming the live tensors replays the timeline once more)."""
    def step() -> None:
        training_step(model, batch, optimizer, loss_fn, amp_dtype)

    for _ in range(warmup_steps):
        step()
    model.zero_grad(set_to_none=True)
    with track_step_memory(batch[0].device, live=live) as tracker:
        step()
    assert tracker.report is not None
    return tracker.report


@contextmanager
def track_step_memory(device: torch.device | str, live: bool = True) -> Iterator[StepMemoryTracker]:
    """Profile the memory of the training step run inside the block, on ``device``:

        with track_step_memory("cuda") as tracker:
            my_training_step()
        tracker.report.peak_bytes

    Only tensors the block's ops touch are counted (on the CPU); tensors alive before the block
    but freed without an op (gradients cleared with ``set_to_none``) are not."""
    device = _with_index(torch.device(device))
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracker = StepMemoryTracker()
    # Kineto prints profiler_start/stop lines and, without a GPU, "ERROR ... gpuGetDeviceCount
    # failed" to stderr at every profile; the CPU profile is complete all the same. Quiet unless the
    # user set a level.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:  # the categorizer needs shapes and the Python calls
        yield tracker
        if on_cuda:
            torch.cuda.synchronize(device)
    memory_profile = prof._memory_profile()
    peak, by_category, start, peak_time = _timeline_peak(memory_profile, device)
    categories = memory_profile._categories
    tracker.report = StepMemoryReport(
        peak_bytes=torch.cuda.max_memory_allocated(device) if on_cuda else peak,
        by_category=by_category,
        start_bytes=start,
        phase=_phase_at(memory_profile, peak_time),
        device=str(device),
        method="torch.cuda.max_memory_allocated" if on_cuda else "profiler: CPU tensor allocations",
        live=live_at_peak(memory_profile, device, peak_time,
                          lambda key, version: CATEGORY_NAMES[categories.get(key, version)]) if live else [],
    )


def _with_index(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _timeline_peak(
    memory_profile: MemoryProfile, device: torch.device
) -> tuple[int, dict[str, int], int, int]:
    """Replay the profiler's timeline on ``device``: (peak bytes, bytes per category at the
    peak, bytes alive before the first event, time of the peak in ns; -1 if before it)."""
    categories = memory_profile._categories

    def category(key: object, version: int) -> str:
        found = categories.get(key, version) if isinstance(key, TensorKey) else None
        return CATEGORY_NAMES[found]

    live: Counter[str] = Counter({name: 0 for name in CATEGORY_NAMES.values()})
    events = [e for e in memory_profile.timeline if e[2][0].device == device]
    peak, peak_split, peak_time, start = 0, dict(live), -1, 0
    for i, (time, action, (key, version), nbytes) in enumerate(events):
        if action in (Action.PREEXISTING, Action.CREATE):
            live[category(key, version)] += nbytes
        elif action == Action.INCREMENT_VERSION:  # an in-place op can move bytes to a new category
            live[category(key, version)] -= nbytes
            live[category(key, version + 1)] += nbytes
        else:
            live[category(key, version)] -= nbytes
        if i + 1 < len(events) and events[i + 1][0] == time:
            continue  # events at one time stamp act together
        total = sum(live.values())
        if time == -1:
            start = total
        if total > peak:
            peak, peak_split, peak_time = total, dict(live), time
    return peak, peak_split, start, peak_time


def _phase_at(memory_profile: MemoryProfile, time: int) -> str | None:
    """The ``training_step`` phase that was running at ``time``, if any."""
    for event in memory_profile._op_tree.dfs():
        if event.name.startswith(_PHASE_LABEL) and event.start_time_ns <= time <= event.end_time_ns:
            return event.name.removeprefix(_PHASE_LABEL)
    return None


# How far the process's resident memory rose over a call (Linux): a check of the profiler's
# allocation counts by a second, allocator-independent method.
#
# glibc keeps freed heap blocks for reuse instead of returning them (a step then reuses pages
# the previous one touched and the growth looks smaller), so resident memory tracks live tensors
# only when large blocks are mmap-ed and unmapped on free: start the process with
# ``MALLOC_MMAP_THRESHOLD_`` fixed (``FIXED_MMAP_ENV``; a fixed value also stops glibc from
# raising the threshold as blocks are freed).

FIXED_MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK = "5"  # clear_refs code that resets VmHWM, the peak resident set, to the current size


def peak_rss_growth(run: Callable[[], object]) -> int:
    """Bytes by which the resident set's peak during ``run()`` exceeded its size before it."""
    if not all(os.environ.get(k) == v for k, v in FIXED_MMAP_ENV.items()):
        warnings.warn("resident memory growth understates live tensors unless the process starts with "
                      f"{FIXED_MMAP_ENV}", stacklevel=2)
    _CLEAR_REFS.write_text(_RESET_PEAK)
    before = _status_bytes("VmRSS")
    run()
    return _status_bytes("VmHWM") - before


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise KeyError(field)
