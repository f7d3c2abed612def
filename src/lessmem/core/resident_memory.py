"""How far the process's resident memory rose over a call (Linux): a check of the profiler's
allocation counts by a second, allocator-independent method.

glibc keeps freed heap blocks for reuse instead of returning them (a step then reuses pages
the previous one touched and the growth looks smaller), so resident memory tracks live tensors
only when large blocks are mmap-ed and unmapped on free: start the process with
``MALLOC_MMAP_THRESHOLD_`` fixed (``FIXED_MMAP_ENV``; a fixed value also stops glibc from
raising the threshold as blocks are freed).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

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
