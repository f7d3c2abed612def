"""Coverage report: every tensor autograd keeps, who saved it, and whether it is compressed.

Two sources are joined by storage: a saved-tensor hook (which module was running, the exact bytes)
and a walk over the autograd graph (which backward op holds the tensor). The op tells *why* a
tensor is kept; the module tells *where*, and whether a compression map can reach it. Bytes are
those ``measure_memory`` counts: the byte ranges saved views span, each byte of a storage once,
the model's parameters, buffers and inputs excluded.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from lessmem.core.compress import uncompress
from lessmem.core.memory import output_tensor, saved_tensors_of, storage_key
from lessmem.core.saved_storage import packed_storage_of

# backward-node name -> (compressed?, how, why). Names ending in "Backward" are ours.
_OURS = {
    "PooledConv2dFunctionBackward": (True, "pooled {spec}", "conv input, for the weight gradient"),
    "PooledLinearFunctionBackward": (True, "pooled {spec} tokens", "linear input, for the weight gradient"),
    "MaskedActivationFunctionBackward": (True, "1-bit mask", "activation pass mask"),
    "CompactMaxPool2dFunctionBackward": (True, "uint8 window index", "max-pool argmax"),
    "StoredBatchNormFunctionBackward": (True, "{storage} (approximate)", "BatchNorm input"),
    "PackedDropoutFunctionBackward": (True, "1-bit mask", "dropout mask"),
    "StoredActivationFunctionBackward": (True, "{storage} (approximate)", "GELU/SiLU input"),
    "RecomputedFunctionBackward": (True, "inputs only, recomputed in backward", "multi-op formula inputs"),
    "SlicedGatedMLPFunctionBackward": (True, "packed per token slice, recomputed in backward",
                                       "gated MLP input and down-projection input"),
}
# Nodes that save only tensors other lessmem nodes keep (``ops.rebuilt_input``): never their owner.
_BORROWERS = {"RebuiltInputConv2dFunctionBackward"}
_STOCK = {
    "ConvolutionBackward": "conv input: layer not compressed (k=1 or not in the map)",
    "NativeBatchNormBackward": "BatchNorm input: exact backward needs it",
    "CudnnBatchNormBackward": "BatchNorm input: exact backward needs it",
    "NativeLayerNormBackward": "LayerNorm input: exact backward needs it",
    "ReluBackward": "ReLU output kept by stock ReLU",
    "ThresholdBackward": "ReLU output kept by stock ReLU",
    "HardtanhBackward": "Hardtanh/ReLU6 input kept by stock op",
    "MaxPool2DWithIndicesBackward": "stock max-pool: full input and int64 indices",
    "AddmmBackward": "linear input: layer not compressed",
    "MmBackward": "linear input: layer not compressed",
    "BmmBackward": "matmul operand",
    "GeluBackward": "GELU input: exact backward needs it",
    "SiluBackward": "SiLU input: exact backward needs it",
    "SoftmaxBackward": "softmax output: exact backward needs it",
    "NativeDropoutBackward": "dropout mask (1 byte per element)",
    "ScaledDotProductFlashAttentionForCpuBackward": "attention q, k, v, output: exact backward needs them",
    "ScaledDotProductEfficientAttentionBackward": "attention q, k, v, output: exact backward needs them",
    "ScaledDotProductFlashAttentionBackward": "attention q, k, v, output: exact backward needs them",
    "ScaledDotProductCudnnAttentionBackward": "attention q, k, v, output: exact backward needs them",
    "CompiledFunctionBackward": "kept by a torch.compile graph",
}
# Ops whose saved tensors feed only the weight gradient: the part pooling can shrink.
_WEIGHT_GRAD_ONLY = ("PooledConv2dFunctionBackward", "PooledLinearFunctionBackward",
                     "ConvolutionBackward", "AddmmBackward", "MmBackward")


@dataclass
class CoverageRow:
    layer: str
    module: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    compressed: bool
    how: str
    why: str
    functional: bool  # saved by a functional call in a container module: no kernel map can reach it (saved_storage can)


@dataclass
class CoverageReport:
    rows: list[CoverageRow]
    stock_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows)

    @property
    def compressed_bytes(self) -> int:
        return sum(r.bytes for r in self.rows if r.compressed)

    @property
    def full_bytes(self) -> int:
        return self.total_bytes - self.compressed_bytes

    @property
    def floor_bytes(self) -> int:
        """What would remain if every conv/linear input cost nothing: the least memory reachable
        while error propagation stays exact (BatchNorm inputs, masks and indices remain)."""
        return sum(r.bytes for r in self.rows if not r.op.startswith(_WEIGHT_GRAD_ONLY))

    def summary(self) -> dict[str, float | int | None]:
        stock = self.stock_bytes
        return {
            "total_bytes": self.total_bytes,
            "compressed_bytes": self.compressed_bytes,
            "full_bytes": self.full_bytes,
            "floor_bytes": self.floor_bytes,
            "stock_bytes": stock,
            "share_of_stock": self.total_bytes / stock if stock else None,
            "floor_share_of_stock": self.floor_bytes / stock if stock else None,
        }

    def as_records(self) -> list[dict]:
        return [asdict(r) | {"shape": "x".join(map(str, r.shape))} for r in self.rows]

    def functional_calls(self) -> list[CoverageRow]:
        return [r for r in self.rows if r.functional]

    def table(self, full_only: bool = False) -> str:
        lines = [f"{'layer':34} {'op':34} {'shape':20} {'dtype':9} {'KiB':>10}  kept as / why"]
        for r in self.rows:
            if full_only and r.compressed:
                continue
            shape = "x".join(map(str, r.shape))
            what = r.how if r.compressed else f"FULL: {r.why}"
            if r.functional:
                what += " [functional call: not reachable by a map; saved_storage reaches it]"
            lines.append(f"{r.layer[:34]:34} {r.op[:34]:34} {shape[:20]:20} {r.dtype:9} "
                         f"{r.bytes / 1024:10.1f}  {what}")
        s = self.summary()
        lines.append(f"total {s['total_bytes'] / 2**20:.2f} MiB = compressed {s['compressed_bytes'] / 2**20:.2f}"
                     f" + full {s['full_bytes'] / 2**20:.2f}; exact-propagation floor {s['floor_bytes'] / 2**20:.2f} MiB")
        if s["stock_bytes"]:
            lines.append(f"stock PyTorch {s['stock_bytes'] / 2**20:.2f} MiB: this run keeps "
                         f"{s['share_of_stock']:.3f}x, floor {s['floor_share_of_stock']:.3f}x")
        return "\n".join(lines)


def _saved_by_op(output: Tensor) -> dict[tuple[str, int], str]:
    """Storage -> name of the backward node holding it, by walking the autograd graph."""
    owners: dict[tuple[str, int], str] = {}
    seen: set[object] = set()
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = node.name().split("::")[-1]
        tensors: list[Tensor] = []
        if name in _BORROWERS:  # holds other nodes' tensors (a from_bn conv): theirs to name
            tensors = []
        elif hasattr(node, "saved_tensors") and not name[-1].isdigit():  # custom Function
            tensors = list(node.saved_tensors)
        else:
            for attr in dir(node):
                if attr.startswith("_saved_"):
                    value = getattr(node, attr, None)
                    if isinstance(value, Tensor):
                        tensors.append(value)
        for t in tensors:
            if t is not None and t.layout == torch.strided:
                owners.setdefault(storage_key(t), name)
        stack.extend(fn for fn, _ in node.next_functions)
    return owners


def _describe(op: str, module: nn.Module | None) -> tuple[bool, str, str]:
    if op in _OURS:
        compressed, how, why = _OURS[op]
        spec = getattr(module, "lessmem_spec", "")
        storage = getattr(module, "lessmem_storage", "")
        return compressed, how.format(spec=spec, storage=storage), why
    stem = op.rstrip("0123456789")
    return False, "full", _STOCK.get(stem, f"kept by {stem or 'an unknown op'}")


def coverage(model: nn.Module, inputs: Tensor | tuple[Tensor, ...], *, compare_stock: bool = True) -> CoverageReport:
    """Every tensor autograd keeps after ``model(inputs)``, with who saved it and how it is stored.

    ``compare_stock`` also measures an uncompressed deep copy of the model for the share of stock.
    """

    args = inputs if isinstance(inputs, tuple) else (inputs,)
    records, out = saved_tensors_of(model, args)
    owners = _saved_by_op(output_tensor(out))
    modules = dict(model.named_modules())
    rows = []
    for rec in records:
        module = modules.get(rec.layer)
        op = owners.get(rec.key, "unknown")
        compressed, how, why = _describe(op, module)
        packed_as = packed_storage_of(rec.key)
        if packed_as is not None:  # its op's backward reads the decoded copy: the graph walk misses it
            op, compressed, how, why = "saved_storage", True, f"{packed_as} (approximate)", "saved tensor of the module"
        if "BatchNorm" in op and len(rec.shape) == 1:
            why = "BatchNorm statistics (per channel)"
        leaf = module is not None and not any(True for _ in module.children())
        rows.append(CoverageRow(
            layer=rec.layer or "(model)",
            module=type(module).__name__ if module is not None else "",
            op=op, shape=rec.shape, dtype=str(rec.dtype).removeprefix("torch."), bytes=rec.nbytes,
            compressed=compressed, how=how, why=why,
            functional=not leaf and not compressed,
        ))
    stock = None
    if compare_stock:
        stock_model = uncompress(copy.deepcopy(model))
        stock_records, _ = saved_tensors_of(stock_model, args)
        stock = sum(r.nbytes for r in stock_records)
    return CoverageReport(rows, stock)
