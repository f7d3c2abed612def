"""Progress of a long loop, by one rule for every command: a tqdm bar where stderr is a terminal;
elsewhere (a log file, a cluster job's captured output) a few plain log lines, because a bar's
carriage returns turn a log file into one unreadable line."""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import Generic, Protocol, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
log = logging.getLogger(__name__)


class Progress(Protocol[T_co]):
    """What both forms offer: iteration, a postfix (``loss=...``) and an early close."""

    def __iter__(self) -> Iterator[T_co]: ...

    def set_postfix(self, **values: object) -> None: ...

    def close(self) -> None: ...


def on_terminal() -> bool:
    """Whether progress is shown as bars: stderr is a terminal."""
    return sys.stderr.isatty()


def with_progress(items: Iterable[T], desc: str, unit: str, total: int | None = None, initial: int = 0,
                  every: int | None = None, leave: bool = True, show: bool = True) -> Progress[T]:
    """``items`` with their progress: a bar on a terminal, else log lines (``LogProgress``: the
    start, a line every ``every`` items, by default each quarter of ``total``, and the end).
    ``initial`` items were done before (a resumed epoch); ``show=False`` (a DDP rank other than
    the first) shows nothing."""
    if total is None and isinstance(items, Sized):
        total = len(items)
    if on_terminal():
        return tqdm(items, desc=desc, unit=unit, total=total, initial=initial, leave=leave, dynamic_ncols=True,
                    disable=not show)
    if every is None:
        every = math.ceil(total / 4) if total else 0
    return LogProgress(items, desc, unit, total, initial, every, show)


class LogProgress(Generic[T]):
    """Progress as log lines: ``<desc>: <n>/<total> <unit> (<pct>%), <rate> <unit>/s[, postfix]``
    every ``every`` items (0: none), after a first line and before a last one with the time taken
    (``show=False``: no lines at all)."""

    def __init__(self, items: Iterable[T], desc: str, unit: str, total: int | None, initial: int, every: int,
                 show: bool) -> None:
        self.items, self.desc, self.unit, self.total = items, desc, unit, total
        self.n = self.initial = initial
        self.every, self.show = every, show
        self.postfix = ""
        self.start = time.perf_counter()
        self.closed = False

    def __iter__(self) -> Iterator[T]:
        if self.show:
            log.info("%s: %s", self.desc, self._count())
        for item in self.items:
            yield item  # the caller's work on it happens here, its postfix included
            self.n += 1
            if (self.show and self.every and self.n % self.every == 0
                    and (self.total is None or self.n < self.total)):  # the last line says the rest
                pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
                log.info("%s: %s%s, %s%s", self.desc, self._count(), pct, self._rate(),
                         f", {self.postfix}" if self.postfix else "")
        self.close()

    def set_postfix(self, **values: object) -> None:
        self.postfix = ", ".join(f"{key} {value}" for key, value in values.items())

    def close(self) -> None:
        """The last line, once: how far it got, in how long (also after a break or an interrupt)."""
        if self.show and not self.closed:
            log.info("%s: %s in %.1fs, %s", self.desc, self._count(), time.perf_counter() - self.start, self._rate())
        self.closed = True

    def _count(self) -> str:
        return f"{self.n}/{self.total} {self.unit}" if self.total is not None else f"{self.n} {self.unit}"

    def _rate(self) -> str:
        return f"{(self.n - self.initial) / (time.perf_counter() - self.start):.3g} {self.unit}/s"
