"""Console entry points. Keep imports light: heavy modules load inside the functions."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import hydra
from omegaconf import DictConfig

from lessmem.paths import conf_dir

CONF_DIR = str(conf_dir())


# --------------------------------------------------------------------------- errors


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
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None


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


# --------------------------------------------------------------------------- train


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _train(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from lessmem.train import run

    if not cfg.get("out_dir"):
        OmegaConf.set_struct(cfg, False)
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    with exit_on_user_error("lessmem-train"):
        m = run(cfg)
    print(
        f"{m['model']} / {m['compression']}: top1 {m['final_top1']:.4f} (best {m['best_top1']:.4f} "
        f"@ epoch {m['best_epoch']}), saved {m['saved_bytes'] / 2**20:.2f} MiB vs stock "
        f"{m['stock_saved_bytes'] / 2**20:.2f} MiB (ratio {m['ratio']:.3f}), "
        f"{m['train_time_s']:.1f}s -> {cfg.out_dir}"
    )
    return float(m["final_top1"])  # for Hydra sweepers that optimize the return value


def train_main() -> None:
    """``lessmem-train`` / ``python -m lessmem.train``: one run (or a sweep with ``-m``); Hydra
    arguments. Bad settings, missing data or an unreadable checkpoint: one error line, exit 2."""
    hydra_entry("lessmem-train", _train)


# --------------------------------------------------------------------------- memory
# (memory_main: owned by another engineer)


# --------------------------------------------------------------------------- sensitivity
# (sensitivity_main: owned by another engineer)


# --------------------------------------------------------------------------- search
# (search_main: owned by another engineer)
