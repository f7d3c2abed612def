"""What a sensitivity measurement found, per Conv2d layer x kernel, the bytes and fidelity of
any per-layer map read from it, and its csv / json files."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lessmem.sensitivity.greedy import greedy_map
from lessmem.sensitivity.plot import plot_heatmap


@dataclass
class SensitivityResult:
    """Per Conv2d layer × kernel: gradient fidelity (mean/std over batches) and saved bytes.

    ``nbytes[i, j]``: bytes layer i keeps of its input with kernel ``kernels[j]`` (pooled size ×
    element size, for the batch size measured). ``input_group[i]``: layers with the same group id
    read the same tensor (ResNet's conv1 and downsample), which the core stores once per kernel.
    """

    layers: list[str]
    kernels: list[int]
    cosine_mean: np.ndarray
    cosine_std: np.ndarray
    relerr_mean: np.ndarray
    relerr_std: np.ndarray
    nbytes: np.ndarray
    input_shapes: list[list[int]]
    input_group: list[int]
    n_batches: int
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- accounting -------------------------------------------------------------------------

    def kernel_index(self, k: int) -> int:
        if k not in self.kernels:
            raise ValueError(f"kernel {k} was not measured; have {self.kernels}")
        return self.kernels.index(k)

    def full_map(self, mapping: Mapping[str, int]) -> dict[str, int]:
        """Kernel of every measured layer (missing layers: 1, as in ``lessmem.compress``)."""
        unknown = set(mapping) - set(self.layers)
        if unknown:
            raise ValueError(f"layers {sorted(unknown)} are not in this result; have {self.layers}")
        return {name: int(mapping.get(name, 1)) for name in self.layers}

    def saved_bytes(self, mapping: Mapping[str, int]) -> int:
        """Conv-input bytes kept for backward under ``mapping`` (layer name -> k).

        Counts a shared input once per distinct kernel, as the core does (``pooled_once``;
        stock convs save the very same tensor). Other saved tensors (BN inputs, ...) do not
        depend on the map and are not included.
        """
        kmap = self.full_map(mapping)
        seen: set[tuple[int, int]] = set()
        total = 0
        for i, name in enumerate(self.layers):
            key = (self.input_group[i], kmap[name])
            if key not in seen:
                seen.add(key)
                total += int(self.nbytes[i, self.kernel_index(kmap[name])])
        return total

    def baseline_bytes(self) -> int:
        return self.saved_bytes({})

    def layer_cosines(self, mapping: Mapping[str, int]) -> dict[str, float]:
        kmap = self.full_map(mapping)
        return {n: float(self.cosine_mean[i, self.kernel_index(kmap[n])]) for i, n in enumerate(self.layers)}

    def mean_cosine(self, mapping: Mapping[str, int]) -> float:
        """Mean over layers of the weight-gradient cosine (unweighted: each layer counts once)."""
        return float(np.mean(list(self.layer_cosines(mapping).values())))

    def uniform_map(self, k: int) -> dict[str, int]:
        self.kernel_index(k)
        return dict.fromkeys(self.layers, k)

    def _budget(self, budget_bytes: float | None) -> float | None:
        """A budget in bytes: ``budget_bytes`` itself, or a fraction of the all-k=1 bytes when <= 1."""
        if budget_bytes is None:
            return None
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        return budget_bytes * self.baseline_bytes() if budget_bytes <= 1 else float(budget_bytes)

    def make_map(
        self,
        budget_bytes: float | None = None,
        min_cosine: float | None = None,
        groups: Sequence[str] | None = None,
    ) -> dict[str, int]:
        """The greedy per-layer map within ``budget_bytes`` and/or above ``min_cosine``
        (``lessmem.sensitivity.greedy``)."""
        if budget_bytes is None and min_cosine is None:
            raise ValueError("make_map needs budget_bytes and/or min_cosine")
        return greedy_map(self, self._budget(budget_bytes), min_cosine, groups)

    # ---- files --------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        base = {i: self.nbytes[i, self.kernel_index(1)] if 1 in self.kernels else self.nbytes[i, 0]
                for i in range(len(self.layers))}
        return [
            {
                "layer": name,
                "kernel": k,
                "cosine_mean": float(self.cosine_mean[i, j]),
                "cosine_std": float(self.cosine_std[i, j]),
                "relerr_mean": float(self.relerr_mean[i, j]),
                "relerr_std": float(self.relerr_std[i, j]),
                "saved_bytes": int(self.nbytes[i, j]),
                "saving_vs_k1": float(1 - self.nbytes[i, j] / base[i]) if base[i] else 0.0,
                "input_shape": "x".join(map(str, self.input_shapes[i])),
                "input_group": self.input_group[i],
            }
            for i, name in enumerate(self.layers)
            for j, k in enumerate(self.kernels)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "kernels": self.kernels,
            "cosine_mean": self.cosine_mean.tolist(),
            "cosine_std": self.cosine_std.tolist(),
            "relerr_mean": self.relerr_mean.tolist(),
            "relerr_std": self.relerr_std.tolist(),
            "nbytes": self.nbytes.tolist(),
            "input_shapes": self.input_shapes,
            "input_group": self.input_group,
            "n_batches": self.n_batches,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SensitivityResult:
        arr = {k: np.asarray(d[k], dtype=float) for k in ("cosine_mean", "cosine_std", "relerr_mean", "relerr_std")}
        return cls(list(d["layers"]), [int(k) for k in d["kernels"]], **arr,
                   nbytes=np.asarray(d["nbytes"], dtype=np.int64), input_shapes=d["input_shapes"],
                   input_group=list(d["input_group"]), n_batches=int(d["n_batches"]),
                   meta=dict(d.get("meta", {})))

    @classmethod
    def load(cls, path: str | Path) -> SensitivityResult:
        path = Path(path)
        return cls.from_dict(json.loads((path / "sensitivity.json" if path.is_dir() else path).read_text()))

    def save(self, out_dir: str | Path, heatmap: bool = True) -> dict[str, Path]:
        """Write sensitivity.csv, sensitivity.json and (optionally) sensitivity.png."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"csv": out / "sensitivity.csv", "json": out / "sensitivity.json"}
        rows = self.rows()
        with paths["csv"].open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1))
        if heatmap:
            title = self.meta.get("title") or f"weight-gradient cosine ({self.n_batches} batches)"
            paths["png"] = plot_heatmap(self.cosine_mean, self.layers, self.kernels, out / "sensitivity.png", title)
        return paths
