"""analysis/ scripts and lessmem.reporting on a tiny sweep and a tiny search made here (synthetic data, CPU)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import open_dict
from PIL import Image

from lessmem import reporting as R
from lessmem.experiment import compose_config
from lessmem.experiment.train import run

REPO = Path(__file__).parents[1]
ANALYSIS = REPO / "analysis"


def valid_png(path: Path) -> None:
    assert path.is_file(), path
    with Image.open(path) as im:
        im.verify()
        assert im.format == "PNG"


def script(name: str):
    """Import analysis/<name>.py as a module (its main(argv) is the CLI)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"analysis_{name}", ANALYSIS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory, tiny: tuple[str, ...]) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    for i, comp in enumerate(("none", "pool2")):
        cfg = compose_config([*tiny, f"compression={comp}"])
        with open_dict(cfg):  # Hydra-style dir name; '=' cannot go through an override
            cfg.out_dir = str(root / f"{i}_compression={comp}")
        run(cfg)
    return root


def test_report_cli_on_sweep(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "rep"
    assert script("report").main([str(sweep), "--out", str(out)]) == 0
    with (out / "table.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["map"] for r in rows] == ["none", "pool2"]
    assert set(R.COLUMNS) <= set(rows[0])
    none, pool2 = rows
    assert float(none["ratio"]) == pytest.approx(1.0) and float(pool2["ratio"]) < 1.0
    assert int(pool2["saved_bytes"]) < int(none["saved_bytes"])
    assert pool2["kernels"] == "*:2" and none["kernels"] == "none"
    for r in rows:
        assert 0.0 <= float(r["top1"]) <= float(r["top5"]) <= 1.0 and float(r["train_time_s"]) > 0
    md = (out / "table.md").read_text()
    assert md.count("\n| ") == 3 and "| pool2 |" in md.replace("1_compression=pool2", "x")  # header + 2 rows
    for name in ("memory_vs_accuracy.png", "accuracy_curves.png"):
        valid_png(out / name)


def test_rows_pareto_and_running_run(sweep: Path, tmp_path: Path) -> None:
    rows = R.load_runs(sweep)
    assert len(rows) == 2 and all(r["complete"] and len(r["history"]) == 1 for r in rows)
    front = R.pareto_front(rows)
    assert front and front[0]["saved_bytes"] == min(r["saved_bytes"] for r in rows)
    # A run still in progress (metrics.jsonl only) is read and marked.
    part = tmp_path / "part"
    part.mkdir()
    (part / "config.yaml").write_text((sweep / "1_compression=pool2" / "config.yaml").read_text())
    hist = json.loads((sweep / "1_compression=pool2" / "metrics.json").read_text())["history"]
    (part / "metrics.jsonl").write_text(json.dumps(hist[0]) + "\n")
    (row,) = R.load_runs(part)
    assert not row["complete"] and row["top1"] == hist[0]["val_top1"] and row["kernels"] == "*:2"
    assert "(running)" in R.markdown_table([row])
    assert R.load_runs(tmp_path / "missing") == []


class _RunsCommand:
    """Pickles as a call of ``os.system(command)``: what a hostile checkpoint.pt can hold."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_report_never_unpickles_a_checkpoint(sweep: Path, tmp_path: Path) -> None:
    """Issue 23: a results folder from elsewhere is reported from its JSON files only; the memory
    columns of a run in progress come from its memory.json, not from checkpoint.pt."""
    import torch

    marker = tmp_path / "MARKER"
    hostile = tmp_path / "hostile.pt"
    torch.save({"memory": _RunsCommand(f"touch {marker}")}, hostile)
    source = sweep / "1_compression=pool2"
    runs = tmp_path / "runs"
    for name in ("done", "running"):
        shutil.copytree(source, runs / name, ignore=shutil.ignore_patterns("checkpoint.pt"))
        shutil.copy(hostile, runs / name / "checkpoint.pt")
    (runs / "running" / "metrics.json").unlink()  # in progress: metrics.jsonl + memory.json

    rep = R.report_dir(runs)
    assert not marker.exists()
    running = next(r for r in rep["rows"] if not r["complete"])
    memory = json.loads((source / "memory.json").read_text())
    assert running["saved_bytes"] == memory["saved_bytes"] and running["ratio"] == memory["ratio"]
    torch.load(hostile, weights_only=False)  # the payload is live: unpickling it runs the command
    assert marker.exists()


def test_kernel_summary() -> None:
    assert R.kernel_summary({"*": 2}) == "*:2"
    assert R.kernel_summary({f"l{i}": k for i, k in enumerate([1, 2, 2, 4, 4, 4])}) == "k1 x1, k2 x2, k4 x3"
    assert R.kernel_summary({}) == "none"


def test_menu_maps_narrowed_menus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """menu_maps.py's narrowed menus keep only their options: the unpooled menu's map pools no
    conv input, the kernel-only one codes none; both fit the budget the published menu predicts."""
    from lessmem.core import CompressionPlan
    from lessmem.sensitivity import MenuResult

    monkeypatch.syspath_prepend(str(ANALYSIS))
    menu = tmp_path / "menu.json"  # the published menu, which the proof's runs.json carries
    menu.write_text(json.dumps(script("compact_runs").read(REPO / "docs/results/proof_resnet20_xhat", "menu/menu.json")))
    script("menu_maps").main([str(menu), "--out", str(tmp_path), "--maps", "grad_error:0.08:unpooled",
                              "grad_error:0.6:kernels"])
    result = MenuResult.load(menu)
    plan = CompressionPlan.read(tmp_path / "grad_error_0.08_unpooled.yaml")
    assert all(str(o) == "1" or not str(o)[0].isdigit() for o in plan.map.values())
    assert any(str(o).startswith("int") for o in plan.map.values())
    assert result.score(plan)["ratio"] <= 0.08
    plan = CompressionPlan.read(tmp_path / "grad_error_0.6_kernels.yaml")
    assert all(str(o).isdigit() for o in plan.map.values()) and plan.norm_storage == "native"
    assert result.score(plan)["ratio"] <= 0.6


def test_menu_maps_narrow_both_parts_of_a_batchnorm_conv_item() -> None:
    """A norm_conv option stays where its BatchNorm part and its conv part both do: the unpooled menu
    keeps codes and from_bn, the kernel-only menu native BatchNorms and native pooling."""
    from lessmem.sensitivity import MenuItem, MenuResult

    options = ["native|1", "native|2", "int2|1", "int2|2/int2", "native|from_bn", "int2|from_bn"]
    item = MenuItem("conv2", "norm_conv", options, [6, 5, 4, 3, 2, 1], {"grad_error": [[0, 1, 2, 3, 4, 5]]},
                    partner="bn1")
    menu = MenuResult([item], 10, 0)
    maps = script("menu_maps")
    assert maps.narrowed(menu, maps.unpooled).items[0].options == ["native|1", "int2|1", "native|from_bn", "int2|from_bn"]
    kept = maps.narrowed(menu, maps.kernel_only).items[0]
    assert kept.options == ["native|1", "native|2"] and kept.nbytes == [6, 5] and kept.criteria == {"grad_error": [[0, 1]]}


def test_menu_maps_recompute_within_a_step_and_read_on_a_later_menu(tmp_path: Path) -> None:
    """``step=R`` recomputes the region where that lowers the error within R stock steps (and not
    beyond R); ``--later`` reads each map item by item on a later menu: the totals are the two
    menus' scores, a recomputed item listed with what its rerun stores (int8) and that error."""
    from lessmem.core import CompressionPlan
    from lessmem.sensitivity import MenuItem, MenuResult
    from lessmem.sensitivity.items import RecomputeOption

    def menu(scale: float) -> MenuResult:
        error = [[0.0, 0.01 * scale, 0.5 * scale]]
        criteria = {"tensor_error": error, "grad_error": error, "loss_change": [[0.0] * 3],
                    "cosine": [[1 - e for e in error[0]]]}
        items = [MenuItem(name, "linear", ["1", "int8", "int2"], [100, 30, 10], criteria) for name in ("a.fc", "b.fc")]
        return MenuResult(items, stock_bytes=200, base_bytes=0, meta={"step_seconds": 1.0},
                          regions=[RecomputeOption("a", delta_bytes=5, seconds=0.1, freed_bytes=95)])

    menu(1.0).save(tmp_path / "early", heatmap=False)
    menu(3.0).save(tmp_path / "late", heatmap=False)
    maps = script("menu_maps")
    maps.main([str(tmp_path / "early/menu.json"), "--out", str(tmp_path), "--later", str(tmp_path / "late/menu.json"),
               "--maps", "tensor_error:0.2", "tensor_error:0.2:step=1.2", "tensor_error:0.2:step=1.05"])
    codes, rerun = (CompressionPlan.read(tmp_path / f"tensor_error_0.2{s}.yaml") for s in ("", "_step1.2"))
    assert codes.recompute == () and CompressionPlan.read(tmp_path / "tensor_error_0.2_step1.05.yaml").recompute == ()
    assert rerun.recompute == ("a",) and rerun.map["b.fc"] == "int8" and rerun.map["a.fc"] == "int8"
    early, late = MenuResult.load(tmp_path / "early/menu.json"), MenuResult.load(tmp_path / "late/menu.json")
    assert early.score(rerun)["tensor_error"] < early.score(codes)["tensor_error"]
    for name, plan in (("tensor_error_0.2", codes), ("tensor_error_0.2_step1.2", rerun)):
        table = (tmp_path / f"later_{name}.md").read_text()
        total = table.splitlines()[-1].split("|")
        assert float(total[3].strip(" *")) == pytest.approx(early.score(plan)["tensor_error"], rel=1e-3)
        assert float(total[4].strip(" *")) == pytest.approx(late.score(plan)["tensor_error"], rel=1e-3)
    assert "| a.fc | recomputed, int8 | 0.01 | 0.03 | 3.00 |" in (tmp_path / "later_tensor_error_0.2_step1.2.md").read_text()


def test_pareto_front_on_any_columns() -> None:
    """The one front for runs and search trials: least memory per accuracy, one row per point,
    the first of equal rows, rows without finite values left out."""
    rows = [{"trial": 0, "bytes": 100, "score": 0.9}, {"trial": 1, "bytes": 50, "score": 0.8},
            {"trial": 2, "bytes": 50, "score": 0.8}, {"trial": 3, "bytes": 70, "score": 0.7},
            {"trial": 4, "bytes": 10, "score": float("nan")}, {"trial": 5, "bytes": 200, "score": 0.95}]
    front = R.pareto_front(rows, mem="bytes", acc="score")
    assert [r["trial"] for r in front] == [1, 0, 5]


def test_report_on_search(tmp_path: Path, tiny: tuple[str, ...]) -> None:
    from lessmem.search import run_search

    base = [*tiny, "compression=none"]
    args = {"study_name": "t", "out_dir": str(tmp_path / "s"), "n_trials": 2, "menu": "kernels", "budget": 0.6,
            "sensitivity.batches": 1, "sensitivity.batch_size": 4}  # the memory batch: bytes compare
    dot = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in args.items()]
    summary = run_search(compose_config([*dot, f"base_overrides={json.dumps(base)}"], "search"))
    out = tmp_path / "rep"
    assert script("report").main([str(tmp_path / "s"), "--out", str(out)]) == 0
    rows = R.load_search(tmp_path / "s")  # from study.journal
    assert len(rows) == 2 and {r["seed"] for r in rows} >= {"knapsack"}
    knapsack = next(r for r in rows if r["seed"] == "knapsack")
    assert knapsack["ratio"] <= 0.6 and knapsack["score"] == pytest.approx(summary["knapsack"]["score"])
    assert knapsack["measured_ratio"] == pytest.approx(knapsack["ratio"])  # the menu's prediction, measured
    front = R.pareto_front(rows)
    assert {r["trial"] for r in front} <= {r["trial"] for r in rows} and front
    with (out / "table.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2
    assert "Pareto" in (out / "table.md").read_text()
    valid_png(out / "memory_vs_accuracy.png")
    (tmp_path / "s" / "study.journal").unlink()  # falls back to trials.csv
    assert len(R.load_search(tmp_path / "s")) == 2


def test_per_layer_script(tmp_path: Path) -> None:
    out = tmp_path / "pl"
    assert script("per_layer").main(["--model", "resnet20", "--map", "*=2", "--batch", "2", "--size", "32",
                                     "--num-classes", "10", "--out", str(out)]) == 0
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    blocks = [r["block"] for r in rows]
    assert "layer1.0" in blocks and "layer3.2" in blocks
    assert sum(int(r["compressed_bytes"]) for r in rows) < sum(int(r["stock_bytes"]) for r in rows)
    valid_png(out.with_suffix(".png"))


def test_ratio_bars(tmp_path: Path) -> None:
    rows = [{"model": m, "config": c, "ratio": r} for m in ("a", "b") for c, r in (("2x2", 0.5), ("4x4", 0.4))]
    valid_png(R.plot_ratio_bars(rows, tmp_path / "bars.png"))


class FakeRun:
    name = "fake"

    def __init__(self) -> None:
        self.logged: list[dict] = []

    def log(self, payload: dict) -> None:
        self.logged.append(payload)


def test_wandb_results_table_columns(sweep: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    from lessmem.experiment.loggers import WandbLogger

    tables, scatters, lines = [], [], []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data
            tables.append(self)

    monkeypatch.setattr(wandb, "Table", Table)
    monkeypatch.setattr(wandb.plot, "scatter", lambda t, x, y, title="": scatters.append((t, x, y)) or "scatter")
    monkeypatch.setattr(wandb.plot, "line", lambda t, x, y, title="": lines.append((t, x, y)) or "line")
    monkeypatch.setattr(wandb, "Image", lambda path: f"image:{Path(path).suffix}")

    run_dir = sweep / "1_compression=pool2"
    logger = object.__new__(WandbLogger)  # no wandb.init: only the end-of-run table
    logger.run = FakeRun()
    import yaml

    logger.cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    metrics = json.loads((run_dir / "metrics.json").read_text())
    logger.results(metrics)
    (table,) = tables
    assert table.columns == R.COLUMNS and len(table.data) == 1
    row = dict(zip(table.columns, table.data[0], strict=True))
    assert row["map"] == "pool2" and row["kernels"] == "*:2" and row["ratio"] == metrics["ratio"]
    assert row["saved_bytes"] == metrics["saved_bytes"] and row["top1"] == metrics["final_top1"]
    assert row["top5"] == metrics["final_top5"] and row["train_time_s"] == metrics["train_time_s"]
    assert scatters == [(table, "saved_bytes", "top1")]
    keys = set().union(*logger.run.logged)
    assert {"tradeoff/table", "tradeoff/memory_vs_accuracy", "tradeoff/accuracy_curves"} <= keys

    # A whole sweep: table, scatter, Pareto table + line, and the matplotlib figure.
    tables.clear(), scatters.clear()
    fake = FakeRun()
    payload = R.log_wandb(fake, R.load_runs(sweep), key="sweep", pareto=True)
    assert [len(t.data) for t in tables][0] == 2 and tables[0].columns == R.COLUMNS
    assert lines and lines[0][1:] == ("saved_bytes", "top1")
    assert {"sweep/table", "sweep/memory_vs_accuracy", "sweep/pareto_table", "sweep/pareto_front",
            "sweep/memory_vs_accuracy_png"} == set(payload)


def test_wandb_offline_sweep_run(sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    payload = R.log_dir_to_wandb(sweep, mode="offline")
    assert "sweep/table" in payload
    assert list((sweep / "wandb").glob("offline-run-*")), "offline run dir for `wandb sync`"


def test_make_results_handles_missing_and_present(sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ANALYSIS))  # it imports its sibling per_layer, as a script does
    mk = script("make_results")
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (results / "memory.csv").write_text(
        "model,config,saved_mib,ratio,note\nresnet18,stock PyTorch,676.9,1.0,\n"
        "resnet18,2x2,374.8,0.554,exact\nresnet18,4x4,332.8,0.492,exact\n")
    (results / "resnet18_per_layer.csv").write_text("block,stock_bytes,compressed_bytes\nstem,100,50\nlayer1.0,80,20\n")
    out = tmp_path / "docs" / "RESULTS.md"
    common = ["--out", str(out), "--results", str(results), "--memory-csv", str(results / "memory.csv"), "--no-measure"]
    assert mk.main([*common, "--cifar", str(tmp_path / "nope")]) == 0
    text = out.read_text()
    assert "## Index" in text and "| [results/memory.csv](results/memory.csv) |" in text  # every study, its evidence
    assert "Pending: no runs" in text and "−29%" in text and "−36%" in text and "-44.6%" in text
    assert "not* CUDA peak" in text and "pending a GPU" in text
    valid_png(results / "memory_ratio.png")
    valid_png(results / "resnet18_per_layer.png")
    # With the sweep in place: its table and PNGs, and the top-1 difference vs `none`.
    assert mk.main([*common, "--cifar", str(sweep)]) == 0
    text = out.read_text()
    assert "Pending: no runs" not in text and "pool2" in text and "points top-1" in text
    for name in ("accuracy_curves.png", "memory_vs_accuracy.png"):
        valid_png(results / "cifar10_resnet20" / name)
        assert f"results/cifar10_resnet20/{name}" in text
    # A checkout without the multirun: the section comes from the report it left in docs/results.
    assert mk.main([*common, "--cifar", str(tmp_path / "nope")]) == 0
    assert "Pending: no runs" not in out.read_text()
    assert cifar_results(out.read_text()) == cifar_results(text)


def cifar_results(page: str) -> str:
    """RESULTS.md's CIFAR-10 section after its commands (they name the ``--cifar`` directory)."""
    section = page.split("## CIFAR-10")[1].split("## Layer sensitivity")[0]
    return section.split("python analysis/report.py", 1)[1].split("\n", 1)[1]


def test_make_results_lm_section_is_the_tracked_proof(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Llama section: every row of docs/results/proof_tiny_llama/summary.json, from the tracked files."""
    monkeypatch.syspath_prepend(str(ANALYSIS))
    section = script("make_results").lm_proof_section(REPO / "docs" / "results" / "proof_tiny_llama", REPO / "docs")
    summary = json.loads((REPO / "docs" / "results" / "proof_tiny_llama" / "summary.json").read_text())
    text = "\n".join(section)
    assert "[summary](results/proof_tiny_llama/summary.md)" in text
    rows = [row for budget in summary["budgets"].values() for row in budget["rows"]]
    for row in rows:
        assert f"| {row['config']} | {row['ratio']:.3f} | {row['mean']:.2f} ± {row['std']:.2f} |" in text
    knapsack = next(row["vs_best_uniform"] for row in rows if "vs_best_uniform" in row)
    assert f"p = {knapsack['p']:.2f}" in text
    assert script("make_results").lm_proof_section(tmp_path, REPO / "docs")[0].startswith("*Not run yet")


def tracked(prefix: str) -> list[str]:
    """The files git tracks under ``prefix`` that the working tree has (none outside a checkout)."""
    listed = subprocess.run(["git", "ls-files", prefix], cwd=REPO, capture_output=True, text=True).stdout.split()
    return [name for name in listed if (REPO / name).is_file()]


def test_results_page_regenerates_from_the_committed_evidence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/RESULTS.md, the one index of the results, and README's converged table come back byte for
    byte from the files git tracks under docs/ (no run folders, no multirun; its plots are written into
    the copy)."""
    monkeypatch.syspath_prepend(str(ANALYSIS))
    names = tracked("docs") + tracked("README.md")
    if not names:
        pytest.skip("not a git checkout")
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    docs = tmp_path / "docs"
    assert script("make_results").main(["--out", str(docs / "RESULTS.md"), "--results", str(docs / "results"),
                                        "--memory-csv", str(docs / "results" / "memory.csv"),
                                        "--cifar", str(tmp_path / "no_multirun"), "--no-measure"]) == 0
    assert (docs / "RESULTS.md").read_text() == (REPO / "docs" / "RESULTS.md").read_text()
    assert (tmp_path / "README.md").read_text() == (REPO / "README.md").read_text()


def _without_code(page: str) -> str:
    return re.sub(r"```.*?```", "", (REPO / page).read_text(), flags=re.S)  # code blocks hold no links


def _anchors(page: str) -> Iterator[str]:
    """The heading anchors GitHub makes for a Markdown page: lower case, every character but letters,
    digits, ``_``, ``-`` and spaces dropped, spaces as ``-``; a repeated one numbered ``-1``, ``-2``."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", _without_code(page), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield f"{slug}-{seen[slug]}" if seen[slug] else slug


def test_every_relative_link_in_the_docs_resolves() -> None:
    """README.md and docs/*.md link only to files (or folders) git tracks, and to headings that a
    linked Markdown page has."""
    names = set(tracked("."))
    if not names:
        pytest.skip("not a git checkout")
    folders = {str(parent) for name in names for parent in Path(name).parents}
    pages = ["README.md", *sorted(n for n in names if re.fullmatch(r"docs/[^/]+\.md", n))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(page)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            if path not in names and path not in folders:
                missing.append(f"{page}: {target}")
            elif anchor and path.endswith(".md") and anchor not in set(_anchors(path)):
                missing.append(f"{page}: {target} (no such heading)")
    assert not missing


def test_hydra_sweep_callback(sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``+hydra.callbacks.tradeoff._target_=lessmem.reporting.WandbSweepCallback``: at the end of a
    multirun, one offline W&B run with the sweep table and the report files."""
    from omegaconf import OmegaConf

    monkeypatch.setenv("WANDB_SILENT", "true")
    logged = []
    import lessmem.reporting.sweep_callback as sweep_callback

    monkeypatch.setattr(sweep_callback, "log_dir_to_wandb", lambda root, **kw: logged.append((Path(root), kw)) or {})
    R.WandbSweepCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    assert logged == [(sweep, {"project": "lessmem", "mode": "offline"})]
    valid_png(sweep / "report" / "memory_vs_accuracy.png")
    assert [r["name"] for r in R.load_runs(sweep)] == ["0_compression=none", "1_compression=pool2"]
