"""What a compressible layer keeps for backward (``LayerSpec``) and how a map value reads as one
(``parse_spec``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lessmem.core.storage import STORAGES, Storage, check_storage

# A conv keeping nothing of its input: backward rebuilds it from the BatchNorm code and ReLU mask
# before it (``ops.rebuilt_input``). Kernel 1, conv layers only.
FROM_NORM = "from_bn"


@dataclass(frozen=True)
class LayerSpec:
    """What a compressible layer keeps for backward: a pooling kernel and a storage format (or
    ``FROM_NORM``: nothing, rebuilt from the layers before it)."""

    kernel: tuple[int, int]
    storage: Storage | Literal["from_bn"] = "native"

    @property
    def exact(self) -> bool:
        return self.kernel == (1, 1) and self.storage == "native"

    def __str__(self) -> str:
        k = f"{self.kernel[0]}x{self.kernel[1]}"
        return k if self.storage == "native" else f"{k}/{self.storage}"


def parse_spec(pattern: str, value: Any) -> LayerSpec:
    """``2`` | ``[2, 4]`` | ``{"kernel": 2, "storage": "int4"}`` | ``"2/int4"`` | ``"2x4/int4"`` |
    ``"int4"`` (kernel 1) | ``"from_bn"`` -> LayerSpec, or a clear error."""
    storage = "native"
    if isinstance(value, str):
        value = _parse_text(pattern, value)
    if isinstance(value, Mapping):
        unknown = set(value) - {"kernel", "storage"}
        if unknown or "kernel" not in value:
            raise ValueError(
                f"compression pattern {pattern!r}: a mapping value needs 'kernel' (and optionally "
                f"'storage'), got keys {sorted(value)}"
            )
        storage = str(value.get("storage", "native"))
        value = value["kernel"]
        if storage == FROM_NORM:
            if value not in (1, [1, 1], (1, 1)):
                raise ValueError(f"compression pattern {pattern!r}: {FROM_NORM!r} keeps nothing to pool; "
                                 f"its kernel is 1, got {value!r}")
            return LayerSpec((1, 1), FROM_NORM)
        storage = check_storage(storage)
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


def _parse_text(pattern: str, text: str) -> dict[str, Any]:
    """``"int4"``, ``"2/int4"``, ``"2x4/bf16"``, ``"2"`` as the mapping form of a spec."""
    kernel_text, _, storage = text.strip().rpartition("/") if "/" in text else ("", "", text.strip())
    if not kernel_text and storage[:1].isdigit():
        kernel_text, storage = storage, "native"
    try:
        sizes = [int(k) for k in kernel_text.lower().split("x")] if kernel_text else [1]
    except ValueError:
        raise ValueError(
            f"compression pattern {pattern!r}: cannot read {text!r}; write k, 'k/storage', "
            f"'khxkw/storage' or a storage alone (storages: {', '.join(STORAGES)})"
        ) from None
    if storage == FROM_NORM:
        return {"kernel": sizes[0] if len(sizes) == 1 else sizes, "storage": storage}
    if storage not in STORAGES and not kernel_text:
        raise ValueError(f"compression pattern {pattern!r}: {text!r} is neither a kernel size (an integer) "
                         f"nor a storage ({', '.join(STORAGES)})")
    if storage not in STORAGES:
        raise ValueError(f"compression pattern {pattern!r}: unknown storage {storage!r} in {text!r}; "
                         f"choose one of {', '.join(STORAGES)} (or {FROM_NORM!r} alone for a conv)")
    return {"kernel": sizes[0] if len(sizes) == 1 else sizes, "storage": storage}


def _is_sequence_config(value: Any) -> bool:
    # omegaconf.ListConfig without importing omegaconf: the core stays torch-only.
    return type(value).__name__ == "ListConfig"
