"""Fault injection for the crash tests (``tests/test_faults.py``).

``LESSMEM_FAULT=<point>:<n>`` makes the process SIGKILL itself (no cleanup, like ``kill -9``) the
n-th time it reaches ``fault_point(<point>)``. Points: ``train_step`` (after an optimizer step)
and ``replace_<file name>`` (an atomic write's temp file written, not yet renamed: e.g.
``replace_checkpoint.pt``). Unset, a call costs one environment lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "LESSMEM_FAULT"
_seen: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] == int(nth or 1):
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
