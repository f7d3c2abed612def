"""Memory accounting: what measure_memory and coverage count.

What measure_memory and coverage count: what the graph keeps alive beyond what the caller
holds anyway. The input batch is the caller's; a saved view counts by the bytes it spans.

Coverage report: what stays full size, checked against an independent saved-tensor count."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torchvision
from torch import nn

import lessmem
from lessmem.models import build_model


@pytest.mark.parametrize("mapping", [None, {"*": 2}], ids=["stock", "pool2"])
def test_a_sliced_batch_counts_like_a_fresh_one(mapping) -> None:
    """resnet20, batch 32: ``big[:32]`` of a 64-batch (a view of a larger storage) and a fresh
    32-batch give the same totals and per-layer bytes, in measure_memory and coverage."""
    torch.manual_seed(0)
    model = build_model("resnet20", 10)
    if mapping:
        lessmem.compress(model, mapping)
    big = torch.randn(64, 3, 32, 32)
    sliced, fresh = big[:32], big[:32].clone()
    a, b = lessmem.measure_memory(model, sliced), lessmem.measure_memory(model, fresh)
    assert a.total_bytes == b.total_bytes > 0
    assert a.per_layer == b.per_layer
    for batch in (sliced, fresh):
        report = lessmem.coverage(model, batch)
        assert report.total_bytes == a.total_bytes
        stock = lessmem.measure_memory(lessmem.uncompress(copy.deepcopy(model)), batch).total_bytes
        assert report.stock_bytes == stock


def test_the_input_batch_is_not_counted() -> None:
    """A conv first saves its input, the caller's batch: nothing the graph adds. Views of the
    batch's storage are the caller's too."""
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    conv = nn.Conv2d(3, 4, 3)
    assert lessmem.measure_memory(conv, x).total_bytes == 0
    assert lessmem.measure_memory(conv, torch.randn(4, 3, 8, 8)[1:3]).total_bytes == 0

    class SliceFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x[:, :2])  # a view of the batch: still the caller's storage

    assert lessmem.measure_memory(SliceFirst(), x).total_bytes == 0
    assert lessmem.coverage(SliceFirst(), x).total_bytes == 0


class SavesViews(nn.Module):
    """Multiplies views of one computed (4, 8) float tensor: the product saves both views."""

    def __init__(self, first: tuple[slice, ...], second: tuple[slice, ...]) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return h[self.first] * h[self.second]


@pytest.mark.parametrize("first, second, spanned", [
    ((slice(0, 2),), (slice(2, 4),), 4 * 8 * 4),  # two halves: the whole storage
    ((slice(0, 1),), (slice(0, 1),), 1 * 8 * 4),  # one row, saved twice: counted once
    ((slice(0, 2),), (slice(1, 3),), 3 * 8 * 4),  # overlapping rows: their union
    ((slice(None), slice(0, 1)), (slice(None), slice(0, 1)), (3 * 8 + 1) * 4),  # a column spans the gaps
])
def test_a_view_counts_the_bytes_it_spans(first, second, spanned) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    model = SavesViews(first, second)
    report = lessmem.measure_memory(model, x)
    assert report.total_bytes == spanned
    assert [t.nbytes for t in report.tensors] == [spanned]
    assert lessmem.coverage(model, x, compare_stock=False).total_bytes == spanned


class _KeepsItsOutput(nn.Module):
    """A layer whose op saves its own output (sigmoid), with a weak reference to that output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.output: weakref.ref | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(self.lin(x))
        self.output = weakref.ref(y)
        return y * 2


@pytest.mark.parametrize("saved_storage", [None, "int8"])
def test_a_forward_only_count_leaves_no_graph_behind(saved_storage) -> None:
    """measure_memory runs no backward: its pack hooks (and the saved-storage hooks inside them)
    must not keep a saved output together with its grad_fn, a cycle through C++ that gc never
    frees (the menu's hundreds of counts grew a tiny Llama's menu to 15 GB)."""
    net = _KeepsItsOutput()
    if saved_storage:
        lessmem.compress(net, None, saved_storage=saved_storage)
    report = lessmem.measure_memory(net, torch.randn(4, 8))
    gc.collect()
    assert report.total_bytes > 0 and net.output is not None and net.output() is None


def test_a_compressed_forward_without_backward_frees_its_graph() -> None:
    """A forward whose backward never comes (an exception mid-step, a forward under grad for
    inspection) frees its graph with its output: the saved-storage hooks keep what they leave
    alone (here a tensor too small to pack) detached."""
    net = lessmem.compress(_KeepsItsOutput(), None, saved_storage="int8")
    out = net(torch.randn(4, 8))
    del out
    gc.collect()
    assert net.output is not None and net.output() is None


def independent_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of storage that saved tensors span (first to last element, found by indexing every
    element), each byte once; parameters, buffers and the input batch excluded."""
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x]}
    covered: dict[int, torch.Tensor] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in held and t.numel():
            positions = torch.arange(storage.nbytes() // t.element_size())
            offsets = positions.as_strided(t.shape, t.stride(), t.storage_offset())
            first, last = int(offsets.min()) * t.element_size(), (int(offsets.max()) + 1) * t.element_size()
            mask = covered.setdefault(storage.data_ptr(), torch.zeros(storage.nbytes(), dtype=torch.bool))
            mask[first:last] = True
        return t.detach()  # no backward follows: a kept grad_fn would leak the graph

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(int(mask.sum()) for mask in covered.values())


def test_resnet18_coverage_pool2():
    model = lessmem.compress(torchvision.models.resnet18(num_classes=10), {"*": 2})
    x = torch.randn(2, 3, 64, 64)
    report = lessmem.coverage(model, x)
    convs = {n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    norms = {n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    conv_rows = [r for r in report.rows if r.layer in convs]
    norm_inputs = [r for r in report.rows if r.layer in norms and len(r.shape) == 4]
    # every conv input pooled (downsample convs share their block's pooled input: counted once)
    assert {r.layer for r in conv_rows} | {n for n in convs if "downsample" in n} == convs
    assert all(r.compressed and r.how == "pooled 2x2" for r in conv_rows)
    # every BatchNorm input kept full, and said why
    assert {r.layer for r in norm_inputs} == norms
    assert all(not r.compressed and "exact backward" in r.why for r in norm_inputs)
    assert report.total_bytes == independent_saved_bytes(model, x)
    assert report.stock_bytes == independent_saved_bytes(lessmem.uncompress(model), x)
    s = report.summary()
    assert s["floor_bytes"] < s["total_bytes"] < s["stock_bytes"]
    assert "FULL: BatchNorm input" in report.table()


def test_functional_calls_are_listed():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return torch.relu(self.conv(x)).sum(dim=(2, 3))

    model = lessmem.compress(Functional(), {"*": 2})
    report = lessmem.coverage(model, torch.randn(2, 3, 8, 8))
    functional = report.functional_calls()
    assert [r.op for r in functional] == ["ReluBackward0"]
    assert functional[0].layer == "(model)"
    assert "not reachable by a map" in report.table()


def test_coverage_cli_writes_table_csv_json_png(tmp_path, run_cli):
    from PIL import Image

    from lessmem.cli.coverage import main

    out = tmp_path / "cov"
    result = run_cli(main, "lessmem-coverage", "model=resnet20", "compression=pool4", "dataset=synthetic",
                     "coverage.batch=2", f"coverage.out={out}")
    assert result.status == 0, result.stderr
    assert "FULL: BatchNorm input" in result.stdout and "pooled 4x4" in result.stdout
    for name in ("coverage.csv", "coverage.json", "coverage.png"):
        assert (out / name).stat().st_size > 0
    with Image.open(out / "coverage.png") as img:
        img.verify()
    bad = run_cli(main, "lessmem-coverage", "model=resnet20", 'compression.map="nope:2"', "dataset=synthetic",
                  f"hydra.run.dir={tmp_path / 'bad'}")
    assert bad.is_one_error("lessmem-coverage", "match no compressible layer")
