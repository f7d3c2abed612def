"""One-line errors for every console command: a bad config, a missing file or an unreadable
checkpoint ends with ``<prog>: error: <message>`` and exit status 2."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any


def one_line(e: BaseException) -> str:
    """An exception's message on one line. Hydra's listings (a heading such as "Available options
    in 'model':" and one tab-indented item per line) become "heading a, b, c"; its "Config search
    path" listing is left out; an OmegaConf cause adds its first line."""
    parts: list[str] = []
    for raw in str(e).splitlines():
        line = raw.strip()
        if not line:
            continue
        if raw.startswith("\t") and parts:  # an item of the listing above
            if parts[-1] is not None:
                parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
        elif line.startswith("Config search path"):
            parts.append(None)  # placeholder that swallows its items
        else:
            parts.append(line)
    text = [p for p in parts if p is not None]
    cause = e.__cause__
    if cause is not None and type(cause).__module__.startswith("omegaconf"):
        first = str(cause).strip().splitlines()
        if first and first[0] not in " ".join(text):
            text.append(f"({first[0]})")
    return "; ".join(text) or type(e).__name__


def user_errors() -> tuple[type[BaseException], ...]:
    """What a bad config, a missing file or an unreadable checkpoint raise (not bugs)."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (ValueError, OSError, HydraException, OmegaConfBaseException, yaml.YAMLError)


_FORCED = "LESSMEM_FORCED_HYDRA_FULL_ERROR"  # HYDRA_FULL_ERROR=1 was set by us, not the user


def _full_error() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1" and not os.environ.get(_FORCED)


@contextlib.contextmanager
def exit_on_user_error(prog: str) -> Iterator[None]:
    """An expected error ends the process with ``<prog>: error: <message>`` (one line on stderr)
    and exit status 2; with ``HYDRA_FULL_ERROR=1`` it propagates (full traceback)."""
    try:
        yield
    except user_errors() as e:
        if _full_error():
            raise
        message = one_line(e)
        if "override 'compression.map'" in message:  # a Hydra dict override of the map (struct error)
            from lessmem.experiment.compression import MAP_FORM

            message += f"; write {MAP_FORM}"
        print(f"{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def job_errors(prog: str) -> contextlib.AbstractContextManager[None]:
    """Inside a ``@hydra.main`` task: a user error of a single run ends with one error line (before
    Hydra adds its "Error executing job" line); in a sweep (``-m``) it fails its own job only, and
    Hydra records it for the sweeper."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return contextlib.nullcontext() if HydraConfig.get().mode == RunMode.MULTIRUN else exit_on_user_error(prog)


def hydra_entry(prog: str, main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` function with one-line errors. Hydra reports its own errors (an
    unknown config group option, a bad override) over several lines and exits, unless
    HYDRA_FULL_ERROR is set; it is set while ``main`` runs so they arrive here as exceptions.
    Errors inside the task are caught there (``exit_on_user_error``), before Hydra adds its
    "Error executing job" line."""
    if _full_error():
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = os.environ[_FORCED] = "1"
    try:
        with exit_on_user_error(prog):
            main()
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
        os.environ.pop(_FORCED, None)
