"""analysis/criterion_summary.py and analysis/proof_summary.py on run directories made here: the
ranking's sign convention, the paired differences and which uniform option is the reference; and
every published summary regenerated from the tracked runs.json alone (analysis/compact_runs.py)."""

from __future__ import annotations

import copy
import importlib
import json
import math
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from lessmem.core import CompressionPlan, compress
from lessmem.models import build_model
from lessmem.sensitivity import MenuOptions, MenuResult, measure_menu

REPO = Path(__file__).parents[1]
ANALYSIS = REPO / "analysis"


def write_run(out: Path, config: str, seed: int, top1: float, ratio: float) -> None:
    run = out / "runs" / config / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"final_top1": top1 / 100, "ratio": ratio}))


@pytest.fixture(autouse=True)
def analysis_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ANALYSIS))  # the scripts import each other by module name


def analysis(name: str, out: Path) -> None:
    importlib.import_module(name).summarize(out)


def without_raw_runs(out: Path) -> None:
    """What a checkout holds: runs.json and the summaries, no run folders or map files."""
    shutil.rmtree(out / "runs")
    shutil.rmtree(out / "maps", ignore_errors=True)


def test_criterion_summary_ranks_a_perfect_predictor_first(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model("resnet20", num_classes=10).train()
    batch = (torch.randn(4, 3, 32, 32), torch.randint(10, (4,)))
    options = MenuOptions(kernels=(1, 2, 4), storages=("native", "int8", "int4"), norm_storages=("int8",),
                          act_storages=())
    menu = measure_menu(model, [batch], options)
    menu.save(tmp_path / "menu")
    (tmp_path / "maps").mkdir()
    write_run(tmp_path, "stock", 0, 90.0, 1.0)
    for name, conv in [("pool2", "2"), ("pool4", "4"), ("int4", "int4"), ("pool2_int4", "2/int4"), ("int8", "int8")]:
        plan = CompressionPlan({"*": conv})
        plan.write(tmp_path / "maps" / f"{name}.yaml")
        score = menu.score(plan)
        write_run(tmp_path, name, 0, 90.0 - 100 * score["grad_error"], score["ratio"])  # accuracy = -error
    analysis("criterion_summary", tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["spearman"]["grad_error"] == pytest.approx(1.0)
    assert summary["best"] == "grad_error" and summary["maps"] == 6
    assert "| whole-gradient relative error | +1.000 |" in (tmp_path / "summary.md").read_text()
    with Image.open(tmp_path / "scatter.png") as im:
        im.verify()
    published = (tmp_path / "summary.json").read_text()
    without_raw_runs(tmp_path)
    analysis("criterion_summary", tmp_path)
    assert (tmp_path / "summary.json").read_text() == published
    assert len(list((tmp_path / "maps").glob("*.yaml"))) == 5  # restored from runs.json


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
    report = "# Menu search: menu_resnet20_b0.15\n\nBest: trial 3.\n\n| trial | score |\n|---|---|\n| 3 | 0.43 |\n"
    (search / "report.md").write_text(report)
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
    text = (tmp_path / "summary.md").read_text()
    assert "| 0.15 | 10 (4) | 5 | 41.00 | trial 3: 43.00 | no | search/b0.15, below |" in text
    assert "### search/b0.15: menu_resnet20_b0.15\n\nBest: trial 3.\n\n| trial | score |" in text  # the report, below
    with Image.open(tmp_path / "frontier.png") as im:
        im.verify()
    published = [(tmp_path / name).read_text() for name in ("summary.json", "summary.md")]
    without_raw_runs(tmp_path)
    shutil.rmtree(tmp_path / "search")  # runs.json carries the search's files
    analysis("proof_summary", tmp_path)
    assert [(tmp_path / name).read_text() for name in ("summary.json", "summary.md")] == published
    importlib.import_module("compact_runs").main(["--restore", str(tmp_path)])
    assert (search / "report.md").read_text() == report and json.loads((search / "summary.json").read_text())["budget"] == 0.15


def test_compact_runs_keeps_reuse_notes_adaptive_maps_and_the_stock_schedule(tmp_path: Path) -> None:
    write_run(tmp_path, "stock", 1, 60.0, 1.0)
    write_run(tmp_path, "stock", 0, 61.0, 1.0)
    (tmp_path / "runs" / "stock" / "seed0" / "config.yaml").write_text("epochs: 3\n")
    (tmp_path / "runs" / "stock" / "seed1" / "REUSED").write_text("copied from elsewhere\n")
    write_run(tmp_path, "adaptive", 0, 59.0, 0.6)
    (tmp_path / "runs" / "adaptive" / "seed0" / "adaptive.jsonl").write_text('{"epoch": 1}\n{"epoch": 2}\n')
    (tmp_path / "runs" / "adaptive" / "seed0" / "metrics.json").write_text(
        json.dumps({"final_top1": 0.59, "ratio": 0.6, "saved_bytes_per_layer": {"conv1": 1}}))
    compact = importlib.import_module("compact_runs")
    table = compact.compact(tmp_path)
    assert list(compact.by_seed(table, "stock")) == [0, 1]
    assert compact.by_seed(table, "stock")[1]["reused_from"] == "copied from elsewhere"
    assert table["stock_config"] == {"epochs": 3}
    adaptive = compact.by_seed(table, "adaptive")[0]
    assert adaptive["adaptive"] == [{"epoch": 1}, {"epoch": 2}] and "saved_bytes_per_layer" not in adaptive
    without_raw_runs(tmp_path)
    assert compact.load(tmp_path) == table
    assert compact.main([]) == 2 and compact.main([str(tmp_path)]) == 2  # nothing given / no runs/ to compact


def test_compact_runs_writes_paths_relative_to_the_repository(tmp_path: Path) -> None:
    """runs.json names no directory of the machine that ran the runs: a run's map file and out_dir,
    a map's header, all relative to the checkout."""
    root = REPO.resolve()
    write_run(tmp_path, "chosen", 0, 60.0, 0.5)
    source = root / "docs" / "results" / "x" / "maps" / "chosen.yaml"
    (tmp_path / "runs" / "chosen" / "seed0" / "metrics.json").write_text(
        json.dumps({"final_top1": 0.6, "ratio": 0.5, "compression_source": str(source)}))
    (tmp_path / "maps").mkdir()
    (tmp_path / "maps" / "chosen.yaml").write_text(f"# from {root / 'docs/results/x/menu/menu.json'}\nmap: {{}}\n")
    table = importlib.import_module("compact_runs").compact(tmp_path)
    assert table["runs"]["chosen"]["0"]["compression_source"] == "docs/results/x/maps/chosen.yaml"
    assert table["maps"]["chosen"].startswith("# from docs/results/x/menu/menu.json\n")
    assert f"{root}/" not in (tmp_path / "runs.json").read_text()


def test_compact_runs_publishes_runs_made_outside_the_checkout(tmp_path: Path) -> None:
    """``--publish SRC DEST``: runs written outside the tree land in DEST/runs.json with SRC's paths
    named as DEST's (relative to the checkout when DEST is in it), a path beside the checkout relative
    to it, and ``--restore`` writes their map files back under DEST."""
    src, dest = tmp_path / "elsewhere", tmp_path / "published"
    write_run(src, "chosen", 0, 60.0, 0.5)
    (src / "runs" / "chosen" / "seed0" / "metrics.json").write_text(json.dumps(
        {"final_top1": 0.6, "ratio": 0.5, "compression_source": str(src / "maps" / "chosen.yaml"),
         "out_dir": str(src / "runs" / "chosen" / "seed0"), "data_root": str(REPO.resolve().parent / "data" / "cifar10")}))
    (src / "maps").mkdir()
    (src / "maps" / "chosen.yaml").write_text(f"# from {src / 'menu/menu.json'}\nmap: {{}}\n")
    compact_runs = importlib.import_module("compact_runs")
    assert compact_runs.main(["--publish", str(src), str(dest)]) == 0
    text = (dest / "runs.json").read_text()
    assert str(src) not in text
    run = json.loads(text)["runs"]["chosen"]["0"]
    assert run["compression_source"] == str(dest / "maps" / "chosen.yaml")
    assert run["out_dir"] == str(dest / "runs" / "chosen" / "seed0")
    assert run["data_root"] == "../data/cifar10"  # beside the checkout: as the configs name it
    assert compact_runs.main(["--restore", str(dest)]) == 0
    assert (dest / "maps" / "chosen.yaml").read_text().startswith(f"# from {dest / 'menu/menu.json'}")
    assert compact_runs.main(["--publish", str(tmp_path / "none"), str(dest)]) == 2
    # Another machine's runs join them (a new seed, a new configuration; the map stays).
    later = tmp_path / "later"
    write_run(later, "chosen", 2, 62.0, 0.5)
    (later / "runs" / "stock" / "seed1").mkdir(parents=True)
    (later / "runs" / "stock" / "seed1" / "metrics.json").write_text(json.dumps({"final_top1": 0.7, "ratio": 1.0}))
    assert compact_runs.main(["--publish", str(later), str(dest)]) == 0
    table = json.loads((dest / "runs.json").read_text())
    assert {c: {s: r["final_top1"] for s, r in seeds.items()} for c, seeds in table["runs"].items()} == \
        {"chosen": {"0": 0.6, "2": 0.62}, "stock": {"1": 0.7}}
    assert list(table["runs"]) == ["chosen", "stock"] and table["maps"]["chosen"].startswith("# from")


def test_compact_runs_packs_the_unfinished_runs_for_another_machine(tmp_path: Path) -> None:
    """``--pack SRC TAR``: the run folders with a step checkpoint and no metrics.json, whole, and SRC's
    top-level files but runs.json and logs; unpacked into a restored folder, the runs are where they stopped."""
    src = tmp_path / "src"
    write_run(src, "stock", 0, 60.0, 1.0)
    (src / "runs" / "stock" / "seed0" / "checkpoint.pt").write_bytes(b"finished")
    stopped = src / "runs" / "chosen" / "seed2"
    stopped.mkdir(parents=True)
    for name, text in {"checkpoint.pt": "step 126", "metrics.jsonl": "{}\n", "config.yaml": "seed: 2\n"}.items():
        (stopped / name).write_text(text)
    for name in ("launch.sh", "proof_full.json", "runs.json", "driver_1.log"):
        (src / name).write_text(name)
    compact_runs = importlib.import_module("compact_runs")
    tar = tmp_path / "partial.tar"
    assert compact_runs.main(["--pack", str(src), str(tar)]) == 0
    back = tmp_path / "back"
    with tarfile.open(tar) as archive:
        archive.extractall(back, filter="data")
    assert sorted(p.relative_to(back).as_posix() for p in back.rglob("*") if p.is_file()) == [
        "launch.sh", "proof_full.json", "runs/chosen/seed2/checkpoint.pt", "runs/chosen/seed2/config.yaml",
        "runs/chosen/seed2/metrics.jsonl"]
    assert (back / "runs/chosen/seed2/checkpoint.pt").read_text() == "step 126"
    assert compact_runs.main(["--pack", str(tmp_path / "none"), str(tar)]) == 2


PUBLISHED = {"budget_proof": "proof_summary", "budget_proof_long": "proof_summary",
             "criterion_check": "criterion_summary", "proof": "proof_2x2_summary",
             "proof_tiny_llama": "proof_summary", "criterion_check_tensor_error": "criterion_summary",
             "proof_resnet20": "proof_summary", "proof_tiny_llama_05_012": "proof_summary",
             "proof_resnet20_0125": "proof_summary", "proof_resnet20_005": "proof_summary",
             "proof_tiny_llama_lr1e3": "proof_summary", "proof_resnet20_xhat": "proof_summary",
             "criterion_check_lm": "criterion_summary", "proof_lora": "proof_summary",
             "proof_lm_converged": "proof_summary", "proof_resnet20_converged": "proof_summary"}


@pytest.fixture(scope="module")
def tracked_results() -> list[str]:
    """The docs/results files git tracks: only git knows, so one git process serves every folder."""
    return subprocess.run(["git", "ls-files", "docs/results"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.split()


def test_published_results_name_no_directory_of_the_machine(tracked_results: list[str]) -> None:
    """No generated result file (runs.json, summary.json) holds an absolute path: runs made outside the
    checkout are published with ``compact_runs.py --publish``, which names them as the folder's own."""
    absolute = re.compile(r'"/[^"/\s]+/[^"\s]*')
    found = {name: hit.group(0) for name in tracked_results if name.endswith(("runs.json", "summary.json"))
             if (hit := absolute.search((REPO / name).read_text()))}
    assert not found


@pytest.mark.parametrize("folder", PUBLISHED)
def test_published_summaries_regenerate_from_tracked_files(folder: str, tracked_results: list[str],
                                                           tmp_path: Path) -> None:
    """docs/results/<folder>/summary.md and .json come back byte for byte from the files git tracks
    (runs.json, the menu, the searches' summaries): the raw run folders are not needed."""
    tracked = [name for name in tracked_results if name.startswith(f"docs/results/{folder}/")]
    if not tracked:
        pytest.skip("not a git checkout")
    for name in tracked:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    out = tmp_path / "docs" / "results" / folder
    assert not (out / "runs").exists()
    analysis(PUBLISHED[folder], out)
    for name in ("summary.md", "summary.json"):
        assert (out / name).read_text() == (REPO / "docs" / "results" / folder / name).read_text(), name


def test_a_proof_directory_reads_as_runs_not_as_a_search(tmp_path: Path) -> None:
    from lessmem.reporting.searches import is_search_dir

    write_run(tmp_path, "stock", 0, 60.0, 1.0)
    (tmp_path / "summary.json").write_text("{}")
    assert not is_search_dir(tmp_path)
    (tmp_path / "trials.csv").write_text("trial\n")
    assert is_search_dir(tmp_path)


def test_proof_driver_plans_maps_that_fit_and_runs_each_search_before_its_best_map(tmp_path: Path) -> None:
    """analysis/proof.py: per budget the knapsack's map and the fitting uniform options spending
    most of it (predicted bytes, exact), the searches launched in the new form and first, their
    best maps trained after them, 8 paired seeds by default."""
    proof = importlib.import_module("proof")
    torch.manual_seed(0)
    options = MenuOptions(kernels=(1, 2, 4), storages=("native", "int8", "int4", "int2", "int1"),
                          norm_storages=("int8", "int4", "int2", "int1"), act_storages=())
    menu = measure_menu(build_model("resnet20", num_classes=10).train(), [(torch.randn(2, 3, 32, 32), torch.tensor([0, 1]))],
                        options)
    menu.save(tmp_path / "menu", heatmap=False)
    preset = proof.PRESETS["resnet20"]
    maps, configs = proof.plan(menu, preset, [0.125, 0.05], per_budget=2, criterion="grad_error",
                               compared=["tensor_error"])
    for budget in ("0.125", "0.05"):
        assert maps[f"chosen_{budget}"].score["ratio"] <= float(budget)
        assert maps[f"tensor_error_{budget}"].score["ratio"] <= float(budget)
        assert configs[f"tensor_error_{budget}"] == {"home": budget, "uniform": False}
        uniform = [c for c, info in configs.items() if info["uniform"] and info["home"] == budget]
        assert 1 <= len(uniform) <= 2 and all(maps[c].score["ratio"] <= float(budget) for c in uniform)
    import argparse

    ns = argparse.Namespace(budgets=[0.125, 0.05], search_trials=3, search_set=[], set=["epochs=1"], seeds=list(range(8)),
                            configs=None, criterion="grad_error")
    jobs = {j.name: j for j in proof.jobs_for(tmp_path, preset, ns, configs, tmp_path / "menu" / "menu.json")}
    assert list(jobs)[:2] == ["search_0.125", "search_0.05"]
    search = jobs["search_0.05"].argv
    assert search[search.index("-cd") + 1] == str(proof.REPO / "sweeps") and search[search.index("-cn") + 1] == "menu_resnet20"
    assert "budget=0.05" in search and "n_trials=3" in search and "criterion=grad_error" in search and f"out_dir={tmp_path / 'search' / 'b0.05'}" in search
    assert {j.split("/")[1] for j in jobs if "/" in j} == {f"seed{s}" for s in range(8)}
    trained = jobs["search_0.05/seed7"]
    assert trained.deps == ["search_0.05"] and trained.needs == [tmp_path / "search" / "b0.05" / "best_map.yaml"]
    assert "epochs=1" in jobs["stock/seed0"].argv
    configs["budget_0.45"] = {"home": "0.05", "uniform": False, "overrides": ["memory_budget=86MiB"]}
    budget_job = next(j for j in proof.jobs_for(tmp_path, preset, ns, configs, tmp_path / "menu" / "menu.json")
                      if j.name == "budget_0.45/seed3")
    assert budget_job.argv[-3:] == ["compression=none", "memory_budget=86MiB", "seed=3"] and not budget_job.needs


def test_proof_driver_copies_map_files_and_refuses_to_overwrite_one(tmp_path: Path) -> None:
    """``--map-files``: a hand map (here the resnet20_from_bn preset) lands in ``maps/<stem>.yaml``;
    another file of that name is an error, not a silent replacement."""
    proof = importlib.import_module("proof")
    (tmp_path / "maps").mkdir()
    preset = REPO / "src/lessmem/conf/compression/resnet20_from_bn.yaml"
    assert proof.copy_map(tmp_path, preset) == "resnet20_from_bn"
    assert (tmp_path / "maps" / "resnet20_from_bn.yaml").read_text() == preset.read_text()
    assert proof.copy_map(tmp_path, preset) == "resnet20_from_bn"  # the same file again: fine
    other = tmp_path / "other" / "resnet20_from_bn.yaml"
    other.parent.mkdir()
    other.write_text("map:\n  '*': 2\n")
    with pytest.raises(SystemExit, match="differs"):
        proof.copy_map(tmp_path, other)


def test_a_part_of_a_proof_keeps_the_proofs_layout() -> None:
    """``--configs``: the layout written by the whole proof (its command, seeds, a hand-written note)
    stays; only a configuration it lacked is added."""
    proof = importlib.import_module("proof")
    before = {"command": "the whole proof, with a note", "seeds": [0, 1, 2],
              "configs": {"stock": {"home": "all"}, "chosen_0.08": {"home": "0.08"}}}
    now = {"command": "--seeds 2 --configs 'chosen_*'", "seeds": [2, 3],
           "configs": {"stock": {"home": "all"}, "chosen_0.08": {"home": "0.05"}, "adaptive_0.08": {"home": "0.08"}}}
    assert proof.part_of(before, now) == {
        "command": "the whole proof, with a note", "seeds": [0, 1, 2, 3],
        "configs": {"stock": {"home": "all"}, "chosen_0.08": {"home": "0.08"}, "adaptive_0.08": {"home": "0.08"}}}


def test_criterion_check_trains_each_distinct_map_once() -> None:
    """Criteria that agree on a budget's map (all of them at a loose budget) give one
    configuration, not two runs of one map."""
    proof = importlib.import_module("proof")
    menu = MenuResult.from_dict(importlib.import_module("compact_runs").read(  # runs.json carries the menu
        REPO / "docs/results/criterion_check_tensor_error", "menu/menu.json"))
    budgets = [0.9, 0.08]
    knapsack = [menu.make_map(b, c) for b in budgets for c in menu.criteria]
    maps = list(proof.criterion_maps(menu, proof.PRESETS["resnet20"], budgets, n=20, seed=0).values())
    assert len(maps) == 20
    assert len({m.plan.digest for m in maps}) == len(maps)  # every map distinct
    assert len({m.plan.digest for m in knapsack}) < len(knapsack)  # there were repeats


def write_lm_run(out: Path, config: str, seed: int, ppl: float, ratio: float) -> None:
    run = out / "runs" / config / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "metrics.json").write_text(json.dumps({"final_val_ppl": ppl, "ratio": ratio, "step_peak_ratio": 0.5 + ratio / 2,
                                                  "history": [{"epoch_time_s": 60.0 + 30 * seed}]}))


def test_proof_summary_of_a_language_model_reads_lower_perplexity_as_better(tmp_path: Path) -> None:
    proof = importlib.import_module("proof")
    configs = {"stock": {"home": "all", "uniform": False}, "int8_all": {"home": "0.5", "uniform": True},
               "int4_all": {"home": "0.5", "uniform": True}, "chosen_0.5": {"home": "0.5", "uniform": False}}
    layout = proof.layout(proof.PRESETS["tiny_llama"], "tiny_llama", configs, [0.5], tmp_path / "menu.json",
                          ["--model", "tiny_llama", "--out", str(tmp_path)])
    (tmp_path / "proof.json").write_text(json.dumps(layout))
    for seed, base in enumerate((8.4, 8.3, 8.5, 8.35)):
        write_lm_run(tmp_path, "stock", seed, base, 1.0)
        write_lm_run(tmp_path, "int8_all", seed, base + 0.6, 0.45)
        write_lm_run(tmp_path, "int4_all", seed, base + 0.3 + 0.01 * seed, 0.3)
        write_lm_run(tmp_path, "chosen_0.5", seed, base + 0.05 * (seed + 1), 0.49)
    analysis("proof_summary", tmp_path)
    result = json.loads((tmp_path / "summary.json").read_text())
    budget = result["budgets"]["0.5"]
    assert budget["best_uniform"] == "int4_all"  # the lowest perplexity
    chosen = next(r for r in budget["rows"] if r["config"] == "chosen_0.5")
    assert chosen["val_ppl"] == pytest.approx([8.45, 8.4, 8.65, 8.55])
    vs = chosen["vs_best_uniform"]
    assert vs["diffs"] == pytest.approx([-0.25, -0.21, -0.17, -0.13]) and vs["p"] < 0.05
    lo, hi = vs["ci95"]
    assert lo <= vs["mean_diff"] <= hi < 0
    assert chosen["vs_stock"]["rel_pct"] == pytest.approx(100 * 0.125 / 8.3875)
    md = (tmp_path / "summary.md").read_text()
    assert "val_ppl: lower is better" in md and "| chosen_0.5 | 0.490 | 0.745 | 1.8 | yes | 4 |" in md  # minutes: median of 1, 1.5, 2, 2.5
    assert "1.8 minutes an epoch" in md and chosen["step_peak_ratio"] == pytest.approx(0.745)


@pytest.mark.slow
def test_criterion_check_on_a_tiny_language_model(tmp_path: Path) -> None:
    """``analysis/proof.py --criterion-check``: the menu measured after warm-up, maps over the
    budgets trained one seed each, each criterion's Spearman with final val_ppl."""
    pytest.importorskip("transformers")
    proof = importlib.import_module("proof")
    tiny = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1", "dataset.seq_len=32",
            "dataset.size_mb=1", "dataset.val_blocks=8", "batch_size=4", "eval_batch_size=8", "memory_batch=4",
            "max_steps_per_epoch=3"]
    proof.PRESETS["tiny_llama"].sensitivity[:] = ["sensitivity.batches=1", "sensitivity.batch_size=4",
                                                 "sensitivity.warmup_steps=2"]
    assert proof.main(["--model", "tiny_llama", "--out", str(tmp_path), "--budgets", "0.3", "--criterion-check", "3",
                       "--set", *tiny, "--workers", "2"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["maps"] >= 4 and set(summary["spearman"]) == {"grad_error", "loss_change", "cosine", "tensor_error", "ratio"}
    assert all(math.isfinite(r["val_ppl"]) for r in summary["rows"])
    assert "Spearman rho with final val_ppl" in (tmp_path / "summary.md").read_text()


def test_averaging_rounding_draws_removes_variance_but_not_pooling_bias() -> None:
    """analysis/map_gradient_error.py --draws: stochastic rounding's error falls with more draws
    averaged; a pooled input's (a deterministic block mean) does not move."""
    mge = importlib.import_module("map_gradient_error")
    torch.manual_seed(0)
    net = nn.Sequential(nn.ReLU(), nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(10, (4,)))]
    loss_fn = nn.CrossEntropyLoss()
    exact = mge.gradients(copy.deepcopy(net), batches, loss_fn)
    for spec, falls in (("int2", True), ("2", False)):
        model = compress(copy.deepcopy(net), {"1": spec})
        one, many = (mge.rel(mge.averaged(model, batches, loss_fn, r)[0], exact[0]) for r in (1, 16))
        assert one > 0 and (many < one / 8 if falls else many == pytest.approx(one, rel=1e-9)), (spec, one, many)


def test_measured_map_errors_rank_against_a_criterion_checks_runs(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    """map_gradient_error --runs: each measured error's Spearman rho with the runs' final metric,
    stock counted as a map of zero error; +1 when the error orders the maps as the metric does."""
    mge = importlib.import_module("map_gradient_error")
    (tmp_path / "proof.json").write_text(json.dumps({"metric": "final_val_ppl", "lower_is_better": True,
                                                     "key": "val_ppl", "scale": 1.0, "budgets": {}, "configs": {}}))
    for config, ppl in (("stock", 8.0), ("a", 8.2), ("b", 9.0), ("c", 11.0)):
        write_lm_run(tmp_path, config, 0, ppl, 0.2)
    mge.rank_against_runs({"a": {"whole": 0.1, "tensor_error": 0.9}, "b": {"whole": 0.2, "tensor_error": 0.1},
                           "c": {"whole": 0.5, "tensor_error": 0.3}}, tmp_path)
    out = capsys.readouterr().out
    assert "measured whole with final final_val_ppl over 4 maps: +1.000" in out
    assert "measured tensor_error with final final_val_ppl over 4 maps: +0.400" in out


def test_every_proof_preset_composes() -> None:
    """Each analysis/proof.py preset's training overrides make a config (a renamed group or key fails here,
    not hours into a proof)."""
    from lessmem.experiment import compose_config

    proof = importlib.import_module("proof")
    for name, preset in proof.PRESETS.items():
        cfg = compose_config([*preset.train, "compression=none"])
        assert cfg.model.name and cfg.epochs >= 1, name
