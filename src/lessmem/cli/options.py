"""A console command's own ``<prefix>.KEY=VALUE`` options, split from its Hydra overrides."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def split_options(argv: Sequence[str], prefix: str, defaults: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """(Hydra overrides, options): ``prefix.KEY=VALUE`` and ``+prefix.KEY=VALUE`` are the
    command's own, their values read as YAML (``4``, ``[1, 2]``, ``null``); the rest go to Hydra.
    ValueError for a KEY not in ``defaults`` or a missing ``=VALUE``."""
    import yaml

    hydra_args, options = [], dict(defaults)
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if not key.startswith(f"{prefix}."):
            hydra_args.append(arg)
            continue
        name = key.split(".", 1)[1]
        if name not in defaults:
            raise ValueError(f"unknown option {arg!r}; {prefix}.* options: {', '.join(sorted(defaults))}")
        if not sep:
            raise ValueError(f"option {arg!r} needs a value: {prefix}.{name}=VALUE")
        options[name] = yaml.safe_load(value)
    return hydra_args, options
