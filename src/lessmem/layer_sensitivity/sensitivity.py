"""Layer sensitivity to compressed activations, from ONE stock forward/backward per batch.

Why one pass is enough: compression only changes what a conv keeps for its *weight* gradient; the
input gradient uses the weight alone and stays exact. So every layer's output gradient is the same
whatever kernel any layer uses (with exact companions and native norm storage), and for each
Conv2d the compressed weight gradient for kernel k is exactly

    convolution_backward(grad_out, expand_blocks(pool_blocks(x, k), k), weight, ...)[1]

with ``x`` the layer's input and ``grad_out`` the gradient of its output from the stock pass.
Hooks capture both, and each layer × kernel costs one extra weight-gradient convolution.
The same argument makes per-layer fidelities composable: the fidelity of any per-layer map is
the per-layer fidelity of its kernels, with no further backward passes (used by ``lessmem.search``).

Imports torch and numpy (matplotlib lazily). The command line (``lessmem-sensitivity``) is
``lessmem.sensitivity_cli``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lessmem.core import expand_blocks, first_match, pool_blocks

log = logging.getLogger(__name__)

DEFAULT_KERNELS = (1, 2, 4, 8)
Batch = Tensor | tuple[Tensor, Tensor] | list[Tensor]


# --------------------------------------------------------------------------- result


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

    # ---- greedy map ---------------------------------------------------------------------------

    def make_map(
        self,
        budget_bytes: float | None = None,
        min_cosine: float | None = None,
        groups: Sequence[str] | None = None,
    ) -> dict[str, int]:
        """Greedy per-layer map. Start at k=1 everywhere; repeatedly apply the upgrade (one unit
        to its next larger kernel) with the most saved bytes per fidelity lost (sum of cosine
        drops), until the bytes are within ``budget_bytes`` (absolute, or a fraction of the all-k=1
        bytes when <= 1), skipping upgrades that would put a layer below ``min_cosine``.

        groups: fnmatch patterns; the layers matching one pattern move together (one unit).
        Layers sharing an input also get a joint move, since upgrading only one of them stores
        an extra pooled copy instead of saving anything.
        """
        if budget_bytes is None and min_cosine is None:
            raise ValueError("make_map needs budget_bytes and/or min_cosine")
        budget = self._budget(budget_bytes)
        units = group_layers(self.layers, groups)
        moves = list(units.values()) + self._joint_moves(units)
        kmap = dict.fromkeys(self.layers, 1)
        while budget is None or self.saved_bytes(kmap) > budget:
            best = self._best_move(kmap, moves, min_cosine)
            if best is None:
                if budget is not None:
                    log.warning("make_map: budget %d B not reached (%d B); min_cosine=%s stops it",
                                budget, self.saved_bytes(kmap), min_cosine)
                break
            kmap = best
        return kmap

    def _budget(self, budget_bytes: float | None) -> float | None:
        if budget_bytes is None:
            return None
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        return budget_bytes * self.baseline_bytes() if budget_bytes <= 1 else float(budget_bytes)

    def _joint_moves(self, units: Mapping[str, list[str]]) -> list[list[str]]:
        owner = {layer: u for u, members in units.items() for layer in members}
        joint: list[list[str]] = []
        for g in sorted(set(self.input_group)):
            sharing = {owner[n] for n, gi in zip(self.layers, self.input_group, strict=True) if gi == g}
            if len(sharing) > 1:
                joint.append([n for u in sorted(sharing) for n in units[u]])
        return joint

    def _best_move(
        self, kmap: dict[str, int], moves: list[list[str]], min_cosine: float | None
    ) -> dict[str, int] | None:
        before_bytes = self.saved_bytes(kmap)
        cos = self.layer_cosines(kmap)
        best, best_score = None, -math.inf
        for move in moves:
            cand = self._upgrade(kmap, move)
            if cand is None:
                continue
            saving = before_bytes - self.saved_bytes(cand)
            new_cos = self.layer_cosines(cand)
            if saving <= 0 or (min_cosine is not None and any(new_cos[n] < min_cosine for n in move)):
                continue
            lost = sum(cos[n] - new_cos[n] for n in move)
            score = saving / max(lost, 1e-12)
            if score > best_score:
                best, best_score = cand, score
        return best

    def _upgrade(self, kmap: dict[str, int], move: list[str]) -> dict[str, int] | None:
        # Every layer of the move goes to the next kernel above the move's smallest one.
        current = min(kmap[n] for n in move)
        larger = [k for k in self.kernels if k > current]
        if not larger:
            return None
        return {**kmap, **dict.fromkeys(move, larger[0])}

    # ---- output -------------------------------------------------------------------------------

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
            paths["png"] = self.plot_heatmap(out / "sensitivity.png")
        return paths

    def plot_heatmap(self, path: str | Path, title: str | None = None) -> Path:
        """Layers × kernel heat map of the mean weight-gradient cosine."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        n, m = self.cosine_mean.shape
        fig, ax = plt.subplots(figsize=(2.0 + 1.1 * m, 1.2 + 0.32 * n))
        im = ax.imshow(self.cosine_mean, cmap="viridis", vmin=min(0.0, float(self.cosine_mean.min())),
                       vmax=1.0, aspect="auto")
        for i in range(n):
            for j in range(m):
                v = self.cosine_mean[i, j]
                ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=7,
                        color="black" if v > 0.6 else "white")
        ax.set_xticks(range(m), [f"{k}x{k}" for k in self.kernels])
        ax.set_yticks(range(n), self.layers, fontsize=7)
        ax.set_xlabel("pooling kernel of the saved input")
        ax.set_title(title or self.meta.get("title") or f"weight-gradient cosine ({self.n_batches} batches)",
                     fontsize=9)
        fig.colorbar(im, ax=ax, label="cosine vs exact")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def group_layers(layers: Sequence[str], groups: Sequence[str] | None) -> dict[str, list[str]]:
    """Units of a search/greedy: ``{pattern: layers}`` (first matching pattern wins); a layer
    matched by no pattern is its own unit, keyed by its name."""
    units: dict[str, list[str]] = {}
    for name in layers:
        key = first_match(name, groups or ()) or name
        units.setdefault(key, []).append(name)
    unused = [p for p in groups or () if p not in units]
    if unused:
        raise ValueError(f"group pattern(s) {unused} match no conv layer; layers: {list(layers)}")
    return units


def write_map_yaml(mapping: Mapping[str, int], path: str | Path, name: str | None = None,
                   comment: str | None = None) -> Path:
    """Write ``mapping`` as a compression config group file (``conf/compression/<name>.yaml``)."""
    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "name": name or path.stem,
        "map": {str(k): int(v) for k, v in mapping.items()},
        "map_file": None,
        "norm_storage": "native",
        "exact_companions": True,
    }
    header = "".join(f"# {line}\n" for line in (comment or "").splitlines())
    path.write_text(header + yaml.safe_dump(body, sort_keys=False))
    return path


# --------------------------------------------------------------------------- measurement


@dataclass
class _Layer:
    name: str
    module: nn.Conv2d
    stride: tuple[int, ...]
    padding: tuple[int, int]
    pre_pad: Callable[[Tensor], Tensor] | None
    extra: tuple[int, int] = (0, 0)  # rows/cols pre_pad adds: the saved tensor is the padded one


def _conv_geometry(name: str, m: nn.Conv2d) -> _Layer | None:
    """Integer padding for convolution_backward; None (skipped) for asymmetric 'same'."""
    if m.padding_mode != "zeros":
        pads, mode = m._reversed_padding_repeated_twice, m.padding_mode
        extra = (pads[2] + pads[3], pads[0] + pads[1])
        return _Layer(name, m, m.stride, (0, 0), lambda x: F.pad(x, pads, mode=mode), extra)
    if isinstance(m.padding, str):
        if m.padding == "valid":
            return _Layer(name, m, m.stride, (0, 0), None)
        total = [d * (k - 1) for k, d in zip(m.kernel_size, m.dilation, strict=True)]
        if any(t % 2 for t in total):
            log.warning("sensitivity: skipping %s (asymmetric padding='same')", name)
            return None
        return _Layer(name, m, m.stride, (total[0] // 2, total[1] // 2), None)
    return _Layer(name, m, m.stride, tuple(m.padding), None)


def conv_layers(model: nn.Module) -> list[_Layer]:
    """Every Conv2d (stock or compressed subclass) whose weight trains."""
    found = [_conv_geometry(n, m) for n, m in model.named_modules()
             if isinstance(m, nn.Conv2d) and m.weight.requires_grad]
    return [f for f in found if f is not None]


def _weight_grad(layer: _Layer, grad_out: Tensor, x: Tensor) -> Tensor:
    m = layer.module
    return torch.ops.aten.convolution_backward(
        grad_out, x, m.weight.detach(), None, layer.stride, layer.padding, m.dilation,
        False, [0, 0], m.groups, [False, True, False],
    )[1]


def _fidelity(exact: Tensor, approx: Tensor) -> tuple[float, float]:
    """(cosine, relative L2 error) in float64; an all-zero exact gradient counts as perfect."""
    e, a = exact.double().flatten(), approx.double().flatten()
    norm = e.norm()
    if norm == 0:
        return (1.0, 0.0) if a.norm() == 0 else (0.0, math.inf)
    cos = float(torch.dot(e, a) / (norm * a.norm()).clamp_min(1e-300))
    return cos, float((a - e).norm() / norm)


class _Recorder:
    """Forward hooks keep each layer's input; a tensor hook on the output computes all kernels'
    weight gradients as soon as the output gradient arrives, then drops the input."""

    def __init__(self, layers: list[_Layer], kernels: Sequence[int]) -> None:
        self.layers, self.kernels = layers, list(kernels)
        self.stats: dict[str, list[tuple[float, float]]] = {}  # "layer/k" -> [(cos, rel)]
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.elem: dict[str, int] = {}
        self.groups: dict[str, tuple[int, tuple[int, ...], str]] = {}
        self._inputs: dict[str, tuple[Tensor, int]] = {}

    def forward_hook(self, layer: _Layer) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            x = args[0]
            if not torch.is_grad_enabled() or not out.requires_grad:
                return
            x = x.detach()
            n, c, h, w = x.shape
            self.shapes[layer.name] = (n, c, h + layer.extra[0], w + layer.extra[1])
            self.elem[layer.name] = x.element_size()
            # Same storage and shape: one tensor read by several convs (stored once by the core).
            # A pre-padded input is a fresh tensor per conv, so it never shares.
            owner = layer.name if layer.pre_pad is not None else ""
            self.groups[layer.name] = (x.untyped_storage().data_ptr(), tuple(x.shape), owner)
            self._inputs[layer.name] = (x, x._version)
            out.register_hook(lambda g: self._backward(layer, g))
        return hook

    def _backward(self, layer: _Layer, grad_out: Tensor) -> None:
        x, version = self._inputs.pop(layer.name)
        if x._version != version:
            raise RuntimeError(f"input of {layer.name} was modified in place after the conv; "
                               "sensitivity needs it unchanged (use non-inplace ops before it)")
        if layer.pre_pad is not None:
            x = layer.pre_pad(x)
        exact = _weight_grad(layer, grad_out, x)
        for k in self.kernels:
            approx = exact if k == 1 else _weight_grad(
                layer, grad_out, expand_blocks(pool_blocks(x, (k, k)), (k, k), x.shape[-2:]))
            self.stats.setdefault(f"{layer.name}/{k}", []).append(_fidelity(exact, approx))

    def pooled_bytes(self, name: str, k: int) -> int:
        n, c, h, w = self.shapes[name]
        return n * c * math.ceil(h / k) * math.ceil(w / k) * self.elem[name]


def _split(batch: Batch) -> tuple[Tensor, Tensor | None]:
    if isinstance(batch, (tuple, list)):
        return batch[0], (batch[1] if len(batch) > 1 else None)
    return batch, None


def _default_loss(out: Tensor, target: Tensor | None) -> Tensor:
    if target is None:  # no labels: any scalar works for fidelity; this one is label-free
        return out.float().square().mean()
    return F.cross_entropy(out, target)


def sensitivity(
    model: nn.Module,
    batches: Iterable[Batch],
    kernels: Sequence[int] = DEFAULT_KERNELS,
    loss_fn: Callable[[Tensor, Tensor | None], Tensor] | None = None,
    *,
    progress: bool = False,
    restore_buffers: bool = True,
) -> SensitivityResult:
    """Weight-gradient fidelity of every Conv2d for each pooling kernel, one backward per batch.

    batches: ``images`` or ``(images, labels)``; moved to the model's device.
    loss_fn(output, labels): cross-entropy by default (mean square of the output without labels).
    The model runs in its current mode (use ``model.train()`` for training-mode BN statistics).
    restore_buffers: put BN running statistics back afterwards, so the probe leaves no trace.
    Assumes the rest of the backward is exact (stock model, or compressed with exact companions
    and native norm storage), which is what makes a single stock pass sufficient.
    """
    kernels = sorted({int(k) for k in kernels})
    if not kernels or kernels[0] < 1:
        raise ValueError(f"kernels must be positive integers, got {kernels}")
    layers = conv_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no trainable Conv2d layer")
    loss_fn = loss_fn or _default_loss
    rec = _Recorder(layers, kernels)
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    saved = {k: v.detach().clone() for k, v in model.named_buffers()} if restore_buffers else {}
    handles = [layer.module.register_forward_hook(rec.forward_hook(layer)) for layer in layers]
    n_batches = 0
    try:
        for batch in _progress(batches, progress):
            x, y = _split(batch)
            out = model(x.to(device))
            loss = loss_fn(out, None if y is None else y.to(device))
            # autograd.grad, not .backward(): no .grad is touched, so this can run mid-training.
            torch.autograd.grad(loss, params, allow_unused=True)
            rec._inputs.clear()  # layers whose output did not reach the loss
            n_batches += 1
    finally:
        for h in handles:
            h.remove()
        if saved:
            with torch.no_grad():
                for k, v in model.named_buffers():
                    v.copy_(saved[k])
    if n_batches == 0:
        raise ValueError("sensitivity got no batches")
    return _collect(rec, layers, kernels, n_batches)


def _progress(batches: Iterable[Batch], enabled: bool) -> Iterable[Batch]:
    if not enabled:
        return batches
    from tqdm.auto import tqdm

    return tqdm(batches, desc="sensitivity", unit="batch", total=getattr(batches, "__len__", lambda: None)())


def _collect(rec: _Recorder, layers: list[_Layer], kernels: list[int], n_batches: int) -> SensitivityResult:
    names = [layer.name for layer in layers if f"{layer.name}/{kernels[0]}" in rec.stats]
    shape = (len(names), len(kernels))
    stats = {key: np.zeros(shape) for key in ("cm", "cs", "rm", "rs")}
    nbytes = np.zeros(shape, dtype=np.int64)
    for i, name in enumerate(names):
        for j, k in enumerate(kernels):
            vals = np.asarray(rec.stats[f"{name}/{k}"])
            stats["cm"][i, j], stats["cs"][i, j] = vals[:, 0].mean(), vals[:, 0].std()
            stats["rm"][i, j], stats["rs"][i, j] = vals[:, 1].mean(), vals[:, 1].std()
            nbytes[i, j] = rec.pooled_bytes(name, k)
    group_ids: dict[tuple[int, tuple[int, ...], str], int] = {}
    groups = [group_ids.setdefault(rec.groups[n], len(group_ids)) for n in names]
    return SensitivityResult(names, kernels, stats["cm"], stats["cs"], stats["rm"], stats["rs"], nbytes,
                             [list(rec.shapes[n]) for n in names], groups, n_batches)


def append_history(result: SensitivityResult, path: str | Path, step: int, epoch: int | None = None) -> None:
    """Append one result as rows (step, epoch, layer, kernel, cosine, ...) to a CSV: sensitivity
    tracked over training. Call at checkpoints with a fixed batch (see the module docs)."""
    path = Path(path)
    rows = [{"step": step, "epoch": epoch, **r} for r in result.rows()]
    new = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)
