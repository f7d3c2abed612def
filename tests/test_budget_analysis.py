"""analysis/criterion_summary.py and analysis/proof_summary.py on run directories made here: the
ranking's sign convention, the paired differences and which uniform option is the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from lessmem.models import build_model
from lessmem.sensitivity import measure_menu, write_map_yaml

ANALYSIS = Path(__file__).parents[1] / "analysis"


def write_run(out: Path, config: str, seed: int, top1: float, ratio: float) -> None:
    run = out / "runs" / config / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"final_top1": top1 / 100, "ratio": ratio}))


def analysis(name: str, out: Path) -> None:
    subprocess.run([sys.executable, str(ANALYSIS / f"{name}.py"), str(out)], check=True, cwd=ANALYSIS,
                   capture_output=True)


def test_criterion_summary_ranks_a_perfect_predictor_first(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("resnet20", num_classes=10).train()
    batch = (torch.randn(4, 3, 32, 32), torch.randint(10, (4,)))
    menu = measure_menu(model, [batch], kernels=(1, 2, 4), storages=("native", "int8", "int4"),
                        norm_storages=("int8",), act_storages=())
    menu.save(tmp_path / "menu")
    (tmp_path / "maps").mkdir()
    write_run(tmp_path, "stock", 0, 90.0, 1.0)
    for name, conv in [("pool2", "2"), ("pool4", "4"), ("int4", "int4"), ("pool2_int4", "2/int4"), ("int8", "int8")]:
        write_map_yaml({"*": conv}, tmp_path / "maps" / f"{name}.yaml")
        score = menu.score({"*": conv})
        write_run(tmp_path, name, 0, 90.0 - 100 * score["grad_error"], score["ratio"])  # accuracy = -error
    analysis("criterion_summary", tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["spearman"]["grad_error"] == pytest.approx(1.0)
    assert summary["best"] == "grad_error" and summary["maps"] == 6
    assert "| whole-gradient relative error | +1.000 |" in (tmp_path / "summary.md").read_text()
    with Image.open(tmp_path / "scatter.png") as im:
        im.verify()


def test_proof_summary_pairs_seeds_against_stock_and_the_best_uniform(tmp_path: Path) -> None:
    for seed, base in enumerate((60.0, 62.0, 61.0)):
        write_run(tmp_path, "stock", seed, base, 1.0)
        write_run(tmp_path, "pool2", seed, base - 1.0, 0.64)
        write_run(tmp_path, "pool4", seed, base - 2.0, 0.547)
        write_run(tmp_path, "int8_bn8", seed, base - 0.3, 0.281)
        write_run(tmp_path, "chosen_4x4", seed, base - 0.1 * (seed + 1), 0.546)
        write_run(tmp_path, "int4_bn2", seed, base - 1.5, 0.125)
        write_run(tmp_path, "chosen_0.15", seed, base - 0.5, 0.149)
        write_run(tmp_path, "search_0.15", seed, base - 0.2, 0.150)
    search = tmp_path / "search" / "b0.15"
    search.mkdir(parents=True)
    (search / "summary.json").write_text(json.dumps({
        "budget": 0.15, "complete_trials": 6, "pruned_trials": 4, "distinct_maps_trained": 5,
        "knapsack": {"trial": 0, "score": 0.41}, "best": {"trial": 3, "score": 0.43}, "best_is_knapsack": False}))
    analysis("proof_summary", tmp_path)
    result = json.loads((tmp_path / "summary.json").read_text())
    at_4x4 = result["budgets"]["4x4"]
    assert at_4x4["best_uniform"] == "int8_bn8"  # fits 4x4's bytes, so it competes there
    chosen = next(r for r in at_4x4["rows"] if r["config"] == "chosen_4x4")
    assert chosen["vs_stock"]["diffs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert chosen["vs_best_uniform"]["mean_diff"] == pytest.approx(0.1)
    at_015 = result["budgets"]["0.15"]
    assert {r["config"] for r in at_015["rows"]} == {"int4_bn2", "chosen_0.15", "search_0.15"}
    assert at_015["best_uniform"] == "int4_bn2"  # a searched map is not a uniform option
    assert next(r for r in at_015["rows"] if r["config"] == "chosen_0.15")["vs_best_uniform"]["mean_diff"] == \
        pytest.approx(1.0)
    assert "| 0.15 | 10 (4) | 5 | 41.00 | trial 3: 43.00 | no | [search/b0.15/report.md]" in \
        (tmp_path / "summary.md").read_text()
    with Image.open(tmp_path / "frontier.png") as im:
        im.verify()


def test_a_proof_directory_reads_as_runs_not_as_a_search(tmp_path: Path) -> None:
    from lessmem.reporting.searches import is_search_dir

    write_run(tmp_path, "stock", 0, 60.0, 1.0)
    (tmp_path / "summary.json").write_text("{}")
    assert not is_search_dir(tmp_path)
    (tmp_path / "trials.csv").write_text("trial\n")
    assert is_search_dir(tmp_path)


def test_proof_driver_trains_each_search_best_map_after_its_search(tmp_path: Path) -> None:
    """analysis/proof.py: a ``search_*`` configuration waits for the menu search of its budget (run
    first, at the ratio the menu predicts for uniform 4x4) and trains that search's best map."""
    import argparse

    sys.path.insert(0, str(ANALYSIS))
    try:
        import proof
    finally:
        sys.path.remove(str(ANALYSIS))
    torch.manual_seed(0)
    menu = measure_menu(build_model("resnet20", num_classes=10).train(), [(torch.randn(2, 3, 32, 32), torch.tensor([0, 1]))],
                        kernels=(1, 2, 4), storages=("native", "int8"), norm_storages=("int8",), act_storages=())
    menu.save(tmp_path / "menu", heatmap=False)
    args = argparse.Namespace(epochs=1, train_subset=100, seeds=[0, 1], configs=["stock", "search_4x4"],
                              menu=tmp_path / "menu" / "menu.json", search_trials=3)
    jobs = {j.name: j for j in proof.jobs_for(tmp_path, args)}
    assert list(jobs)[0] == "search_4x4"
    ratio = menu.uniform("4")["ratio"]
    assert f"budget={ratio:.4g}" in jobs["search_4x4"].argv and "n_trials=3" in jobs["search_4x4"].argv
    for seed in (0, 1):
        train = jobs[f"search_4x4/seed{seed}"]
        assert train.deps == ["search_4x4"]
        assert train.needs == [tmp_path / "search" / f"b{ratio:.4g}" / "best_map.yaml"]
