"""What a compressible layer keeps for backward (``LayerSpec``), and how a map value reads as one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lessmem.core.storage import Storage, check_storage


@dataclass(frozen=True)
class LayerSpec:
    """What a compressible layer keeps for backward: a pooling kernel and a storage format."""

    kernel: tuple[int, int]
    storage: Storage = "native"

    @property
    def exact(self) -> bool:
        return self.kernel == (1, 1) and self.storage == "native"

    def __str__(self) -> str:
        k = f"{self.kernel[0]}x{self.kernel[1]}"
        return k if self.storage == "native" else f"{k}/{self.storage}"


def parse_spec(pattern: str, value: Any) -> LayerSpec:
    """``2`` | ``[2, 4]`` | ``{"kernel": 2, "storage": "bf16"}`` -> LayerSpec, or a clear error."""
    storage = "native"
    if isinstance(value, Mapping):
        unknown = set(value) - {"kernel", "storage"}
        if unknown or "kernel" not in value:
            raise ValueError(
                f"compression pattern {pattern!r}: a mapping value needs 'kernel' (and optionally "
                f"'storage'), got keys {sorted(value)}"
            )
        storage = check_storage(str(value.get("storage", "native")))
        value = value["kernel"]
    if isinstance(value, (list, tuple)) or _is_sequence_config(value):
        items = list(value)
        if len(items) != 2:
            raise ValueError(f"compression pattern {pattern!r}: kernel {items} must be k or [kh, kw]")
    else:
        items = [value, value]
    for k in items:
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError(
                f"compression pattern {pattern!r}: kernel size {k!r} is not an integer "
                "(use e.g. 1 for exact, 2 or 4 for pooling)"
            )
        if k < 1:
            raise ValueError(f"compression pattern {pattern!r}: kernel size {k} must be >= 1")
    return LayerSpec((items[0], items[1]), storage)


def _is_sequence_config(value: Any) -> bool:
    # omegaconf.ListConfig without importing omegaconf: the core stays torch-only.
    return type(value).__name__ == "ListConfig"
