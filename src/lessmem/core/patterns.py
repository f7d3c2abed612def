"""Module-name patterns (fnmatch, case-sensitive): the one rule every map in lessmem follows,
"first matching pattern wins"."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable


def first_match(name: str, patterns: Iterable[str]) -> str | None:
    """The first of ``patterns`` that matches ``name``, or None."""
    return next((p for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def unmatched(patterns: Iterable[str], names: Iterable[str]) -> list[str]:
    """The patterns that match none of ``names`` (a typo in a map is an error, not a no-op)."""
    names = list(names)
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
