"""Coverage report: what stays full size, checked against an independent saved-tensor count."""

from __future__ import annotations

import torch
import torchvision
from torch import nn

import lessmem


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
