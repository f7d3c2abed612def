"""Memory sizes in the units users write: ``"6GiB"``, ``"750MiB"``, ``"1.5GB"``, ``"500000000"``."""

from __future__ import annotations

import re

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(size: str | int | float) -> int:
    """Bytes of ``size``: a number of bytes, or a number with a unit (KiB, MiB, GiB, TiB binary;
    KB, MB, GB, TB decimal; case-insensitive). A bad size is a one-line ValueError."""
    if isinstance(size, bool):
        raise ValueError(f"memory size must be bytes or a number with a unit such as 6GiB, got {size!r}")
    if isinstance(size, int | float):
        value, unit = float(size), ""
    else:
        match = _SIZE.match(str(size))
        if not match or match.group(2).lower() not in UNITS:
            raise ValueError(f"memory size {size!r} is not bytes or a number with a unit "
                             "(KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 6GiB, 750MiB, 500000000")
        value, unit = float(match.group(1)), match.group(2).lower()
    nbytes = int(value * UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"memory size must be positive, got {size!r}")
    return nbytes


def format_bytes(nbytes: float) -> str:
    """The shortest exact binary-unit spelling (``6GiB``, ``750MiB``), else MiB with 2 decimals."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{int(nbytes // scale)}{unit}"
    if nbytes < 2**20:
        return f"{int(nbytes)}B"
    return f"{nbytes / 2**20:.2f}MiB"
