"""Regenerate docs/RESULTS.md, the one index of the measured results (and its PNGs), from the
committed evidence under docs/results. The page is the same on any machine: it names the machine
that measured the evidence (``MACHINE``), not the one that regenerates it; tests/test_analysis.py
checks that the committed page comes back byte for byte.

    python analysis/make_results.py
    python analysis/make_results.py --cifar multirun/cifar10_resnet20_4ep --out docs/RESULTS.md

Inputs (each optional; a missing one becomes a "pending" note, never an error):
  docs/results/memory.csv          python benchmarks/memory.py --csv docs/results/memory.csv
  docs/results/resnet18_per_layer.csv   measured here once (lessmem.measure_memory), then reused
  multirun/cifar10_resnet20_4ep    three lessmem.train runs (none, pool2, pool4), 4 epochs (CIFAR_CMD);
                                   without it, the report it left in docs/results/cifar10_resnet20/
  docs/results/proof_tiny_llama/   summary.json and runs.json of the tiny Llama proof
  docs/results/*/summary.md        the proofs' and criterion checks' summaries, embedded
  docs/results/search_*/summary.json, sensitivity_*/, vit_*.md   (search / sensitivity / ViT docs)
  the first line of every page the index lists (its title)
Outputs: docs/RESULTS.md, docs/results/memory_ratio.png, docs/results/resnet18_per_layer.png,
docs/results/cifar10_resnet20/{table.md,table.csv,memory_vs_accuracy.png,accuracy_curves.png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
from pathlib import Path

from compact_runs import by_seed, load_tracked
from per_layer import per_layer_memory

from lessmem import reporting as R

REPO = Path(__file__).resolve().parents[1]
# Paper (Barley & Fröning, arXiv 2409.11902), ResNet18: total peak GPU memory and top-1.
PAPER = {"2x2": {"peak_reduction": 0.29}, "4x4": {"peak_reduction": 0.36}, "top1_gap_2x2": 0.013}
CIFAR_DIR = "multirun/cifar10_resnet20_4ep"
CIFAR_CMD = ("for c in none pool2 pool4; do OMP_NUM_THREADS=1 python -m lessmem.cli.train compression=$c epochs=4 batch_size=128 "
             "device=cpu logger=csv hydra.run.dir=multirun/cifar10_resnet20_4ep/$c & done; wait")
# The machine that measured the committed evidence (the evidence files name it too).
MACHINE = "2-core x86-64 CPU (AMD EPYC), no GPU; Python 3.11.7, torch 2.14.1+cu130, torchvision 0.29.1+cu130"


def rel(p: Path, base: Path) -> str:
    return os.path.relpath(p, base)


def memory_section(mem_csv: Path, results: Path, docs: Path) -> tuple[list[str], dict]:
    if not mem_csv.is_file():
        return [f"*Pending: `{rel(mem_csv, REPO)}` is missing; run "
                f"`python benchmarks/memory.py --csv {rel(mem_csv, REPO)}` and regenerate.*", ""], {}
    rows = R.read_memory_csv(mem_csv)
    png = R.plot_ratio_bars(rows, results / "memory_ratio.png",
                            title="saved-for-backward bytes / stock PyTorch (224x224, fp32, random init)")
    batches = sorted({str(r.get("batch") or 32) for r in rows})
    lines = ["Command: `python benchmarks/memory.py --csv docs/results/memory.csv` (batch 32, 224×224, fp32, "
             "random init, train mode, CPU). Baseline of every ratio: **stock PyTorch, same model, same "
             "batch** (`lessmem.measure_memory` of the uncompressed model).", "",
             f"![ratio to stock]({rel(png, docs)})", "",
             "| model | batch | config | saved MiB | ratio to stock | change | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r.get('batch') or 32} | {r['config']} | {r['saved_mib']:.1f} | {r['ratio']:.3f} | "
                     f"{100 * (r['ratio'] - 1):+.1f}% | {r['note']} |")
    r18 = {r["config"]: r["ratio"] for r in rows if r["model"] == "resnet18"}
    if {"2x2", "4x4"} <= set(r18):
        lines += ["", f"How 2×2 keeps {r18['2x2']:.2f}× of resnet18's stock bytes with exact error propagation: conv "
                  "inputs pooled (¼), ReLU masks as bits (1/32), the max-pool's argmax as uint8 instead of its full "
                  "input plus int64 indices, one pooled copy shared by a block's conv1 and downsample conv. What "
                  "remains is mostly BatchNorm inputs, which an exact backward needs (`lessmem-coverage` lists them; "
                  "they are the exact-propagation floor, 0.47× stock on resnet18). `naive 2x2` is the trap: conv "
                  "inputs pooled while ReLU and MaxPool still keep full tensors. These "
                  f"{100 * (r18['2x2'] - 1):.0f}% / {100 * (r18['4x4'] - 1):.0f}% are of the activations kept for "
                  "backward; the paper's denominator, the whole step, is in "
                  "[results/peak_memory.md](results/peak_memory.md). (Measured again after the count stopped "
                  "counting the caller's input batch: before, resnet18 stock was 676.9 MiB and 2×2 / 4×4 0.554× / "
                  "0.492×.)"]
    if len(batches) > 1 or batches != ["32"]:
        lines += ["", "Rows at a batch other than 32: the batch-32 run of that model was killed by the "
                  "kernel's OOM killer on this 23 GiB machine (the counting pass keeps every saved tensor "
                  "alive, on top of forward transients); those rows come from "
                  "`python benchmarks/memory.py --models <model> --batch <batch>`. Saved bytes are linear in "
                  "the batch, so ratios are batch-independent and MiB scale by 32/batch. Values are rounded "
                  "to 0.1 MiB / 3 decimals (the benchmark's printed table)."]
    ours = {r["config"]: r["ratio"] for r in rows if r["model"] == "resnet18"}
    ours["_small_batch"] = sorted({r["model"] for r in rows if str(r.get("batch") or 32) != "32"})
    return lines + [""], ours


def per_layer_section(results: Path, docs: Path, measure: bool, batch: int) -> list[str]:
    cache = results / "resnet18_per_layer.csv"
    if not cache.is_file():
        if not measure:
            return [f"*Pending: `{rel(cache, REPO)}` missing (run without `--no-measure`).*", ""]
        rows = per_layer_memory("resnet18", {"*": 2}, batch=batch, size=224)
        with cache.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["block", "stock_bytes", "compressed_bytes"])
            w.writeheader()
            w.writerows(rows)
    with cache.open() as f:
        rows = [{"block": r["block"], "stock_bytes": int(r["stock_bytes"]),
                 "compressed_bytes": int(r["compressed_bytes"])} for r in csv.DictReader(f)]
    png = R.plot_per_layer(rows, results / "resnet18_per_layer.png", label="lessmem 2x2 (*:2)",
                           title=f"resnet18, batch {batch}, 224x224: saved bytes per block")
    stock, comp = sum(r["stock_bytes"] for r in rows), sum(r["compressed_bytes"] for r in rows)
    lines = [f"`python analysis/per_layer.py --model resnet18 --map '*=2' --batch {batch} --size 224 "
             f"--out docs/results/resnet18_per_layer` (random init; per-module bytes of "
             "`lessmem.measure_memory(...).per_layer` summed per block; a storage shared by two modules "
             "is counted once, at the first one that saved it). Total: stock "
             f"{stock / R.MiB:.1f} MiB, 2x2 {comp / R.MiB:.1f} MiB ({comp / stock:.3f}).", "",
             f"![resnet18 per block]({rel(png, docs)})", "",
             "| block | stock MiB | 2x2 MiB | ratio |", "|---|---|---|---|"]
    for r in rows:
        ratio = r["compressed_bytes"] / r["stock_bytes"] if r["stock_bytes"] else float("nan")
        lines.append(f"| {r['block']} | {r['stock_bytes'] / R.MiB:.1f} | {r['compressed_bytes'] / R.MiB:.1f} | {ratio:.3f} |")
    return lines + [""]


def committed_cifar(out: Path) -> tuple[list[dict], str, dict[str, Path]]:
    """The report a finished multirun left in ``out`` (table.csv / table.md / PNGs are tracked; the
    multirun is not): its rows, its table and its figures."""
    with (out / "table.csv").open() as f:
        rows = [{**r, "top1": float(r["top1"]) if r["top1"] else None, "epochs": int(r["epochs"]),
                 "epochs_planned": int(r["epochs"]), "complete": r.get("complete", "True") == "True"}
                for r in csv.DictReader(f)]
    table = (out / "table.md").read_text().split("\n\n", 1)[1]  # its title is this section's own
    return rows, table, {p.name: p for p in sorted(out.glob("*.png"))}


def cifar_section(cifar: Path, results: Path, docs: Path) -> tuple[list[str], list[dict]]:
    out = results / "cifar10_resnet20"
    rows = R.load_runs(cifar)
    committed = not rows and (out / "table.csv").is_file()
    if committed:
        rows, table, files = committed_cifar(out)
    epochs = sorted({int(r.get("epochs_planned") or 0) for r in rows} - {0}) or [4]
    head = [f"Command (full CIFAR-10: 50k train / 10k test images, augmentation on, SGD lr 0.1, Nesterov momentum 0.9, weight decay 5e-4, "
            f"cosine over {'/'.join(map(str, epochs))} epochs, batch 128, fp32, seed 0, saved bytes measured "
            "on a batch of 32; the three runs in parallel on the 2-core CPU):", "", f"    {CIFAR_CMD}",
            f"    python analysis/report.py {CIFAR_DIR}", ""]
    if not rows:
        return head + [f"*Pending: no runs under `{rel(cifar, REPO)}` yet. Rerun "
                       "`python analysis/make_results.py` once the multirun has finished.*", ""], []
    running = [r["name"] for r in rows if not r.get("complete", True)]
    if not committed:  # the multirun is here: its report afresh into docs/results/cifar10_resnet20
        if out.exists():
            shutil.rmtree(out)
        done = min(int(r.get("epochs") or 0) for r in rows)
        title = f"resnet20, CIFAR-10, {'/'.join(map(str, epochs))} epochs (CPU)" + (
            f" - PARTIAL, >= {done} epoch(s) done" if running else "")
        rep = R.report_dir(cifar, out, title=title)
        table, files = rep["markdown"], rep["files"]
    lines = head + [table]
    if running:
        lines += [f"*Still running when this file was generated: {', '.join(running)} — numbers are "
                  "from the epochs finished so far.*", ""]
    base = next((r for r in rows if r.get("map") == "none"), None)
    if base and base.get("top1") is not None:
        lines += ["Top-1 difference to `none` (same schedule, same seed): " + ", ".join(
            f"{r['map']} {100 * (r['top1'] - base['top1']):+.2f} points" for r in rows
            if r is not base and r.get("top1") is not None) + " (the paper's \"within 1.3%\" is for a longer "
            "schedule, not reproduced on this CPU). Baseline of `ratio to stock`: the same "
            "resnet20 with no compression, saved-for-backward bytes on a batch of 32.", ""]
    for name in ("accuracy_curves.png", "memory_vs_accuracy.png"):
        if name in files:
            lines += [f"![{name}]({rel(files[name], docs)})", ""]
    return lines, rows


def search_section(results: Path, docs: Path) -> list[str]:
    lines = ["Details: [sensitivity.md](results/sensitivity.md) (the sensitivity, then the search). "
             "Memory here is conv-input bytes kept for backward (the part a map changes); baseline: "
             "all convs exact (k=1), batch 32, resnet18 CIFAR stem. Score: mean weight-gradient cosine "
             "vs exact (random init, 4 CIFAR-10 batches) — a fidelity proxy, not accuracy.", ""]
    found = False
    for summ in sorted(results.glob("search_*/summary.json")):
        s = json.loads(summ.read_text())
        found = True
        base = s["baseline_conv_input_bytes"]
        lines += [f"**{s['study']}** ({s['objective']}, {s['mode']}, {s['complete_trials']} trials):", "",
                  "| point | conv-input bytes | of all-1 | score |", "|---|---|---|---|"]
        for k, v in sorted(s.get("seeds", {}).items()):
            lines.append(f"| seed {k} | {v['conv_input_bytes']:,d} | {v['conv_input_bytes'] / base:.3f} | {v['score']:.4f} |")
        for p in s.get("pareto", []):
            if p["trial"] in s.get("beats_uniform_2", []):
                lines.append(f"| Pareto trial {p['trial']} (beats uniform 2x2) | {p['conv_input_bytes']:,d} | "
                             f"{p['conv_input_bytes'] / base:.3f} | {p['score']:.4f} |")
        png = summ.parent / "pareto.png"
        lines += ["", f"![pareto]({rel(png, docs)})" if png.is_file() else "", ""]
    sens = results / "sensitivity_resnet18_cifar" / "sensitivity.png"
    if sens.is_file():
        lines += [f"![sensitivity]({rel(sens, docs)})", ""]
    if not found:
        lines += ["*No search summaries under docs/results/search_*/.*", ""]
    lines += ["The accuracy-objective search on real data (each trial trains resnet20, median pruning) is "
              "part of the proof runs below.", ""]
    return lines


def proof_section(proof: Path, docs: Path) -> list[str]:
    """The accuracy proof (analysis/proof_2x2.py): its summary.md, links made relative to docs/."""
    md = proof / "summary.md"
    if not md.is_file():
        return ["*Not run yet: `python analysis/proof_2x2.py` then `python analysis/proof_2x2_summary.py`.*", ""]
    prefix = rel(proof, docs)
    text = md.read_text().split("\n", 1)[1]  # drop its title
    for name in ("accuracy.png", "curves.png", "ranking.png"):
        text = text.replace(f"({name})", f"({prefix}/{name})")
    return [re.sub(r"^(#+) ", r"\1# ", text, flags=re.M), ""]


def budget_section(results: Path, docs: Path) -> list[str]:
    """Issue 19: the menu measurement, the criterion check and the budget proof (their summary.md
    files, written by analysis/criterion_summary.py and analysis/proof_summary.py)."""
    return embedded_summaries(results, docs, (
        ("menu.md", "The compressor menu of resnet20", "lessmem-sensitivity ..."),
        ("criterion_check/summary.md", "Does the criterion predict accuracy?",
         "python analysis/criterion_check.py, then python analysis/criterion_summary.py"),
        ("budget_proof/summary.md", "Maps at a memory budget: chosen vs uniform vs searched, paired seeds",
         "python analysis/proof.py --epochs 2 --train-subset 10000, then python analysis/proof_summary.py"),
        ("budget_proof_long/summary.md", "The same at 4x4's bytes on the issue-12 schedule (4 epochs x 20k)",
         "python analysis/proof.py --out docs/results/budget_proof_long --reuse docs/results/proof "
         "--configs chosen_4x4 int8_bn8 stock, then python analysis/proof_summary.py docs/results/budget_proof_long"),
        ("criterion_check_tensor_error/summary.md", "The criterion check again, with the per-tensor error",
         "lessmem-sensitivity on epoch-1 stock weights into docs/results/criterion_check_tensor_error/menu, then "
         "python analysis/criterion_summary.py docs/results/criterion_check_tensor_error"),
        ("proof_resnet20/summary.md", "At 0.08x on the issue-12 schedule: the cosine's map, the per-tensor error's map, "
         "uniform options", "python analysis/proof.py --model resnet20 --out docs/results/proof_resnet20 --budgets 0.08 "
         "--search-trials 0 --compare-criteria tensor_error, then python analysis/proof_summary.py"),
        ("proof_resnet20_0125/summary.md", "At 0.125x on the issue-12 schedule: the knapsack's map against uniform int4 "
         "+ int2 BatchNorm", "python analysis/proof.py --model resnet20 --out docs/results/proof_resnet20_0125 --budgets "
         "0.125 --search-trials 0 --uniform-per-budget 1 --menu docs/results/proof_resnet20/menu/menu.json"),
        ("proof_resnet20_005/summary.md", "At 0.05x on the issue-12 schedule (4 seeds): the knapsack's map against "
         "uniform 2x2 int1 + int1 BatchNorm; conv inputs rebuilt from their BatchNorm's codes (`from_bn_0.05`, 8 seeds)",
         "python analysis/proof.py --model resnet20 --out docs/results/proof_resnet20_005 "
         "--budgets 0.05 --search-trials 0 --uniform-per-budget 1 --menu docs/results/proof_resnet20/menu/menu.json "
         "--seeds 0 1 2 3; from_bn_0.05: the same with --configs from_bn_0.05 --map-files DIR/maps/from_bn_0.05.yaml "
         "--seeds 0 1 2 3 4 5 6 7"),
        ("proof_resnet20_xhat/summary.md", "At 0.08x with BatchNorm's integer codes of the normalized input (b43f399): "
         "the knapsack's map of a menu measured with them and of that menu without pooled options, conv inputs rebuilt "
         "from their BatchNorm's code (`from_bn_0.08`, `compression=resnet20_from_bn`), uniform int1 + int2 and int2 + "
         "int1 BatchNorm, int2 + int2 BatchNorm (0.094x, over the budget), and the knapsack's maps of the menu that offers "
         "`from_bn` (`joint_0.08`, `joint_0.08_unpooled`)",
         "python analysis/proof.py --model resnet20 --out docs/results/proof_resnet20_xhat --budgets 0.08 --search-trials 0 "
         "--uniform-per-budget 2 --criterion tensor_error --configs 'chosen_*' int1_bn2 int2_bn1 from_bn_0.08 "
         "tensor_error_0.08_unpooled --map-files DIR/maps/from_bn_0.08.yaml DIR/maps/tensor_error_0.08_unpooled.yaml"),
    ))


def lm_budget_section(results: Path, docs: Path) -> list[str]:
    """Issue 31 on the language model: the tight budget and the criterion check."""
    return embedded_summaries(results, docs, (
        ("proof_tiny_llama_lr1e3/summary.md", "At 0.25x and 0.12x with lm_quick's tuned learning rate (1e-3): the "
         "knapsack's maps against uniform int8, uniform int2 and stock",
         "python analysis/proof.py --model tiny_llama --out docs/results/proof_tiny_llama_lr1e3 --budgets 0.25 0.12 "
         "--search-trials 0 --uniform-per-budget 1"),
        ("proof_tiny_llama_05_012/summary.md", "At 0.5x and 0.12x (lr 2e-3): the knapsack's maps (at 0.12x the full "
         "menu, and without token pooling) against uniform bf16 and int2",
         "python analysis/proof.py --model tiny_llama --set optimizer.lr=2e-3 --out docs/results/proof_tiny_llama_05_012 "
         "--budgets 0.5 0.12 --search-trials 0 --uniform-per-budget 1"),
        ("criterion_check_lm/summary.md", "Does the criterion predict val_ppl? (16 maps, seed 0)",
         "python analysis/proof.py --model tiny_llama --set optimizer.lr=2e-3 --out docs/results/criterion_check_lm --budgets 0.5 0.25 0.12 "
         "--criterion-check 16"),
    ))


def embedded_summaries(results: Path, docs: Path, items: tuple[tuple[str, str, str], ...]) -> list[str]:
    """Each (summary.md under ``results``, heading, the command when it is missing) one heading level
    down, its links rewritten to work from ``docs``."""
    lines = []
    for sub, title, missing in items:
        md = results / sub
        lines += [f"### {title}", ""]
        if not md.is_file():
            lines += [f"*Not run yet: `{missing}`.*", ""]
            continue
        text = md.read_text()
        if text.startswith("# "):
            text = text.split("\n", 1)[1]
        prefix = rel(md.parent, docs)
        text = re.sub(r"\]\((?!https?:|/|#)([^)]+)\)", lambda m, prefix=prefix: f"]({os.path.normpath(os.path.join(prefix, m.group(1)))})", text)
        lines += [re.sub(r"^(#+) ", r"\1## ", text, flags=re.M).strip(), ""]
    return lines


# The tiny Llama proof at 0.25x (issue 22): its own section.
LM_BUDGET = "0.25"
LM_COMMAND = ("`python analysis/proof.py --model tiny_llama --set optimizer.lr=2e-3 --out docs/results/proof_tiny_llama --budgets 0.25 "
           "--search-trials 0\n--uniform-per-budget 1 --menu docs/results/proof_tiny_llama/menu/menu.json`")
# Measured before the stochastic rounding (seeds 0 and 1, everything int8); no tracked file keeps those runs.
BIASED = "+7.1% (seed 0) / +6.7% (seed 1)"


def signed(x: float, digits: int = 2) -> str:
    """``+0.02`` / ``−0.14``: the sign always, a typographic minus as the rest of the page has."""
    return f"{x:+.{digits}f}".replace("-", "−")


def interval(ci: list[float]) -> str:
    return f"[{signed(ci[0])}, {signed(ci[1])}]"


def lm_proof_section(folder: Path, docs: Path) -> list[str]:
    """The tiny Llama proof section, from the tracked summary.json and runs.json of
    ``docs/results/proof_tiny_llama`` (analysis/proof_summary.py and analysis/compact_runs.py write them)."""
    summary_path = folder / "summary.json"
    if not summary_path.is_file():
        return [f"*Not run yet: {LM_COMMAND}, then `python analysis/proof_summary.py docs/results/proof_tiny_llama`.*", ""]
    summary = json.loads(summary_path.read_text())
    runs = load_tracked(folder)
    stock = summary["stock"]
    rows = sorted(summary["budgets"][LM_BUDGET]["rows"], key=lambda r: r["ratio"])
    uniform = next(r for r in rows if r["uniform"])
    chosen = next(r for r in rows if not r["uniform"])
    seeds = len(stock["seeds"])
    link = os.path.relpath(folder / "summary.md", docs)
    table = ["| config | saved ratio | val_ppl mean ± std | vs stock (paired) | p | 95% CI (bootstrap) |",
             "|---|---:|---:|---:|---:|---|",
             f"| stock | 1.000 | {stock['mean']:.2f} ± {stock['std']:.2f} | | | |"]
    for r in rows:
        vs = r["vs_stock"]
        table.append(f"| {r['config']} | {r['ratio']:.3f} | {r['mean']:.2f} ± {r['std']:.2f} | "
                     f"{signed(vs['mean_diff'])} ({signed(vs['rel_pct'])}%) | {vs['p']:.2f} | {interval(vs['ci95'])} |")
    first = uniform["vs_stock"]
    seed0 = 100 * first["diffs"][0] / (uniform["val_ppl"][0] - first["diffs"][0])
    upper = 100 * first["ci95"][1] / stock["mean"]
    knap = chosen["vs_best_uniform"]
    peaks = {r["config"]: by_seed(runs, r["config"])[0] for r in (uniform, chosen)}
    batch = peaks[uniform["config"]]["memory_batch"]
    return [
        f"`experiment=lm_quick` (tiny Llama, 300 AdamW steps on byte-level text of Python's standard library, "
        f"val_ppl on\n256 held-out blocks), seeds 0-{seeds - 1}, every configuration on the same seeds; "
        f"[summary]({link}).",
        f"`{uniform['config']}`: every saved tensor in int8 codes, now rounded stochastically (unbiased); "
        f"`{chosen['config']}`: the menu\nknapsack's map at {LM_BUDGET}x (criterion: mean cosine; the menu with the "
        "LM's saved-tensor regions measured after 100 stock\nsteps on 4 batches of 4 sequences).",
        "",
        *table,
        "",
        f"Before the rounding became unbiased, everything-int8 cost {BIASED}; now seed 0 is {signed(seed0, 1)}% "
        f"and the\n{seeds}-seed mean is {signed(first['rel_pct'])}% (within 1% of stock; the interval's upper end "
        f"is {signed(upper, 1)}%). The knapsack's map against uniform\nint8: {signed(knap['mean_diff'])} val_ppl "
        f"({signed(knap['rel_pct'])}%), p = {knap['p']:.2f}, 95% CI {interval(knap['ci95'])}: **no difference "
        f"this proof can see** (an honest\nnegative at {seeds} seeds; seed-to-seed spread of the paired "
        f"differences is ±{statistics.stdev(knap['diffs']):.1f}). Whole-step peak (memory.json, batch {batch}):\n"
        + ", ".join(f"{name} {m['step_peak_ratio']:.3f}x" for name, m in peaks.items())
        + " of stock (before issue 29's sliced LM paths, which these runs predate).",
        f"Runs: {LM_COMMAND} plus the `{uniform['config']}` rows (commands in\nthe summary); summary: "
        "`python analysis/proof_summary.py docs/results/proof_tiny_llama`.",
        "",
    ]


def embed_table(md: Path, docs: Path) -> list[str]:
    """The tables of a page, each under the heading of its section (in italics)."""
    if not md.is_file():
        return [f"*Missing: {rel(md, REPO)}*", ""]
    lines = md.read_text().splitlines()
    out = [f"From [{md.name}]({rel(md, docs)}):", ""]
    heading, shown = None, None
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|"):
            if i and not lines[i - 1].startswith("|"):  # a table starts
                if out[-1] != "":
                    out.append("")
                if heading != shown:
                    out += [f"*{heading}*", ""]
                    shown = heading
            out.append(line)
    return out + [""]


# Every study, in the index: (what it measured, its evidence as (label, path under docs/), what made it).
MEASURES = [
    ("Saved-for-backward bytes: torchvision models, stock vs k=1, 2×2, 4×4 and lossy BatchNorm inputs",
     [("results/memory.csv", "results/memory.csv")], "`python benchmarks/memory.py --csv docs/results/memory.csv`"),
    ("Saved bytes per block: resnet18, stock vs 2×2", [("results/resnet18_per_layer.csv", "results/resnet18_per_layer.csv")],
     "`python analysis/per_layer.py --model resnet18 --map '*=2' --batch 32 --size 224 --out docs/results/resnet18_per_layer`"),
    ("Whole-step peak, the paper's measure: resnet18, resnet50, mobilenet_v2, tiny Llama; the largest batch under a cap",
     [("results/peak_memory.md", "results/peak_memory.md")], "`python benchmarks/peak_memory.py` (each round's command on the page)"),
    ("Memory budgets in bytes of the whole training step (`memory_budget=`, `lessmem-plan`)",
     [("results/budget.md", "results/budget.md")], "`python benchmarks/budget.py` (commands on the page)"),
    ("Step time, compressed vs stock (eager and compiled)",
     [("results/speed.md", "results/speed.md"), ("raw outputs", "results/speed_raw.md")],
     "`python benchmarks/speed.py` (the line heading each raw output)"),
    ("timm and Hugging Face models: saved bytes, exact and lossy 8-bit", [("results/zoo.md", "results/zoo.md")],
     "`python benchmarks/zoo.py` (commands on the page)"),
    ("vit_b_16: saved bytes with pooled tokens", [("results/vit_memory.md", "results/vit_memory.md")],
     "`python benchmarks/memory.py --models vit_b_16 --batch 8`"),
    ("Whole-step peak under `torch.compile` (tiny Llama)", [("compile.md", "compile.md")],
     "`python benchmarks/compile_memory.py`"),
    ("Context per memory budget: LoRA r16 on a 135M Llama (HF stock, HF checkpointing, lessmem lossy and exact)",
     [("results/budget.md", "results/budget.md#how-long-a-context-fits-lora-on-a-135m-llama-issue-45")],
     "`python benchmarks/context.py` (command on the page)"),
]
STUDIES = [
    ("resnet20 on CIFAR-10, 4 epochs: stock vs 2×2 vs 4×4 (seed 0)",
     [("results/cifar10_resnet20/table.md", "results/cifar10_resnet20/table.md")], "the three runs of the CIFAR-10 section below"),
    ("vit_tiny_cifar on CIFAR-10, short CPU schedule", [("results/vit_memory.md", "results/vit_memory.md")],
     "`lessmem-train model=vit_tiny_cifar ...` (on the page)"),
    ("lm_quick: stock vs `{\"*\": 2}` vs `lossy_int8`, one seed (tiny Llama)", [("transformers.md", "transformers.md")],
     "`lessmem-train experiment=lm_quick ...` (on the page)"),
    ("Layer sensitivity: resnet18 (CIFAR stem), random init", [("results/sensitivity.md", "results/sensitivity.md")],
     "`lessmem-sensitivity model=resnet18_cifar ... menu=kernels` (on the page)"),
    ("Map search on a fidelity objective: resnet18 (CIFAR stem)", [("results/sensitivity.md", "results/sensitivity.md")],
     "a search tool since removed (on the page)"),
    ("The compressor menu of resnet20: every option's bytes and gradient error", [("results/menu.md", "results/menu.md")],
     "`lessmem-sensitivity model=resnet20 ...` (on the page)"),
]
# The proofs' folders: (folder under docs/, what it measured, runs made by, summary by).
PROOFS = [
    ('results/proof', 'Issue 12: sensitivity-chosen maps vs uniform 2×2 at the same bytes (resnet20, 3-5 seeds)',
     '`python analysis/proof_2x2.py --out docs/results/proof --epochs 4 --train-subset 20000 --workers 2`',
     '`python analysis/proof_2x2_summary.py docs/results/proof`'),
    ('results/criterion_check', 'Does the criterion predict accuracy? 27 maps, one seed each (resnet20)',
     '`python analysis/criterion_check.py --out docs/results/criterion_check --workers 2` (maps: `--extra` files from `analysis/menu_maps.py`)',
     '`python analysis/criterion_summary.py docs/results/criterion_check`'),
    ('results/budget_proof', 'Maps at a memory budget: chosen vs uniform vs searched, 5 paired seeds (resnet20, 2 epochs on 10k images)',
     '`python analysis/proof.py --out docs/results/budget_proof --epochs 2 --train-subset 10000` with the issue-19 driver (`git show 1fdba62^:analysis/proof.py`; chosen maps from `analysis/menu_maps.py`)',
     '`python analysis/proof_summary.py docs/results/budget_proof`'),
    ('results/budget_proof_long', 'The same on the issue-12 schedule (resnet20, 4 epochs on 20k images)',
     '`python analysis/proof.py --out docs/results/budget_proof_long --reuse docs/results/proof --configs chosen_4x4 int8_bn8 stock` with the issue-19 driver (`git show 1fdba62^:analysis/proof.py`)',
     '`python analysis/proof_summary.py docs/results/budget_proof_long`'),
    ('results/criterion_check_tensor_error', 'The criterion check again, with the per-tensor error (resnet20)',
     "the criterion check's runs (runs.json copied); menu: `lessmem-sensitivity model=resnet20 dataset.train_subset=10000 sensitivity.batches=8 sensitivity.batch_size=32 sensitivity.checkpoint=EPOCH1.pt`",
     '`python analysis/criterion_summary.py docs/results/criterion_check_tensor_error`'),
    ('results/proof_resnet20', "At 0.08×: the cosine's map, the per-tensor error's map, uniform options (resnet20)",
     '`python analysis/proof.py --model resnet20 --out docs/results/proof_resnet20 --budgets 0.08 --search-trials 0 --compare-criteria tensor_error`',
     '`python analysis/proof_summary.py docs/results/proof_resnet20`'),
    ('results/proof_tiny_llama', "At 0.25×: unbiased int8 codes and the menu's map (tiny Llama, lr 2e-3)",
     '`python analysis/proof.py --model tiny_llama --set optimizer.lr=2e-3 --out docs/results/proof_tiny_llama --budgets 0.25 --search-trials 0 --uniform-per-budget 1` (+ the `lossy_int8` runs, see its summary)',
     '`python analysis/proof_summary.py docs/results/proof_tiny_llama`'),
    ('results/proof_resnet20_0125', "At 0.125×: the knapsack's map against uniform int4 + int2 BatchNorm (resnet20)",
     '`python analysis/proof.py --model resnet20 --out docs/results/proof_resnet20_0125 --budgets 0.125 --search-trials 0 --uniform-per-budget 1 --menu docs/results/proof_resnet20/menu/menu.json`',
     '`python analysis/proof_summary.py docs/results/proof_resnet20_0125`'),
    ('results/proof_resnet20_005', "At 0.05×: the knapsack's map, uniform 2×2 int1 + int1 BatchNorm, rebuilt conv inputs (resnet20)",
     '`python analysis/proof.py --model resnet20 --out docs/results/proof_resnet20_005 --budgets 0.05 --search-trials 0 --uniform-per-budget 1 --menu docs/results/proof_resnet20/menu/menu.json --seeds 0 1 2 3` (`from_bn_0.05`: the same with `--configs from_bn_0.05 --map-files DIR/maps/from_bn_0.05.yaml --seeds 0 1 2 3 4 5 6 7`)',
     '`python analysis/proof_summary.py docs/results/proof_resnet20_005`'),
    ('results/proof_resnet20_xhat', 'At 0.08× with BatchNorm codes of the normalized input: rebuilt conv inputs (`from_bn`), the unpooled knapsack, the menu that offers `from_bn` (resnet20, 8 paired seeds)',
     "`python analysis/proof.py --model resnet20 --out docs/results/proof_resnet20_xhat --budgets 0.08 --search-trials 0 --uniform-per-budget 2 --criterion tensor_error --configs 'chosen_*' int1_bn2 int2_bn1 from_bn_0.08 tensor_error_0.08_unpooled --map-files DIR/maps/from_bn_0.08.yaml DIR/maps/tensor_error_0.08_unpooled.yaml` (stock shared with proof_resnet20; `int2_bn2` by its map file on the same schedule; the map files: `compact_runs.py --restore-maps`)",
     '`python analysis/proof_summary.py docs/results/proof_resnet20_xhat`'),
    ('results/proof_tiny_llama_lr1e3', "At 0.25× and 0.12× with lm_quick's tuned lr 1e-3 (tiny Llama, 8 paired seeds)",
     '`python analysis/proof.py --model tiny_llama --out docs/results/proof_tiny_llama_lr1e3 --budgets 0.25 0.12 --search-trials 0 --uniform-per-budget 1` (stock seeds 0-1 shared with the learning-rate sweep)',
     '`python analysis/proof_summary.py docs/results/proof_tiny_llama_lr1e3`'),
    ('results/proof_tiny_llama_05_012', "At 0.5× and 0.12×: the knapsack with and without token pooling against uniform bf16 and int2 (tiny Llama, lr 2e-3)",
     '`python analysis/proof.py --model tiny_llama --set optimizer.lr=2e-3 --out docs/results/proof_tiny_llama_05_012 --budgets 0.5 0.12 --search-trials 0 --uniform-per-budget 1` (+ `unpooled_0.12` and `search_0.12`, see its summary)',
     '`python analysis/proof_summary.py docs/results/proof_tiny_llama_05_012`'),
    ('results/proof_resnet20_converged', "At convergence: the default menu's map at 0.08×, the paper's 2×2, `memory_budget=` at 0.45× of stock's step peak, the map re-chosen every 10 epochs (resnet20, all of CIFAR-10, `experiment=cifar10_converged`, 3 paired seeds)",
     "frozen worktree, output outside the tree: `python analysis/proof.py --model resnet20_converged --out DIR --uniform-per-budget 0 --search-trials 0 --map-files src/lessmem/conf/compression/pool2.yaml --override-configs budget_0.45:memory_budget=86MiB --threads 1 --seeds 0 1 2 --workers 1` (+ `adaptive_0.08`; commands in its summary), then `python analysis/compact_runs.py --publish DIR docs/results/proof_resnet20_converged`",
     '`python analysis/proof_summary.py docs/results/proof_resnet20_converged`'),
    ('results/proof_lm_converged', "At convergence: the menu's maps at 0.25× and 0.12×, codes alone and with recomputed layers (tiny Llama, `experiment=lm_converged`, 3 paired seeds)",
     "frozen worktree, output outside the tree: `python analysis/proof.py --model lm_converged --out DIR --uniform-per-budget 0 --search-trials 0 --threads 1 --seeds 0 1 2 --workers 1` (+ `--map-files` of the recompute maps; commands in its summary), then `python analysis/compact_runs.py --publish DIR docs/results/proof_lm_converged`",
     '`python analysis/proof_summary.py docs/results/proof_lm_converged`'),
    ('results/proof_lora', "LoRA fine-tuning (lora_quick) at 0.15× and 0.102× of stock LoRA's saved bytes: the menu's maps, the menu's map with codes and recompute (`recompute_0.15`) and `lossy_int8` (tiny Llama + LoRA r 8, 3 paired seeds)",
     "`python analysis/proof.py --model tiny_llama_lora --out docs/results/proof_lora --seeds 0 1 2 --search-trials 0 --uniform-per-budget 0 --budgets 0.15 0.102 --map-files src/lessmem/conf/compression/lossy_int8.yaml --set model.init_checkpoint=outputs/lm_quick_seed0/checkpoint.pt` (0.102×: the tightest the menu reaches, 0.1002×); `recompute_0.15`: the map of `lessmem-sensitivity experiment=lora_quick sensitivity.warmup_steps=50 sensitivity.batches=4 sensitivity.batch_size=16 menu.recompute=true sensitivity.max_step_ratio=1.25 sensitivity.budget=0.15`, then the same driver with `--map-files` it too and `--configs recompute_0.15`",
     '`python analysis/proof_summary.py docs/results/proof_lora`'),
    ('results/criterion_check_lm', 'Does the criterion predict val_ppl? 16 maps, seed 0 (tiny Llama)',
     '`python analysis/proof.py --model tiny_llama --set optimizer.lr=2e-3 --out docs/results/criterion_check_lm --budgets 0.5 0.25 0.12 --criterion-check 16`',
     '`python analysis/criterion_summary.py docs/results/criterion_check_lm`'),
]

FOLDERS = [
    "Every study folder under docs/results keeps its summaries (md, json, png) and one `runs.json`: per "
    "configuration and seed, each finished run's metrics.json (less its per-layer bytes), the map file it "
    "trained and the first stock run's config, and the drivers' other outputs (the proof's layout, its "
    "menu, its searches' summaries, trials and reports, per-epoch sensitivity tables). "
    "`python analysis/compact_runs.py DIR` writes it; the summary scripts rewrite it whenever raw runs are "
    "present. The raw run folders (`runs/`, `logs/`, `maps/`, Optuna `trials/` and `study.journal`) are not "
    "in git; the commands in the index above make them again (hours of CPU). The summaries regenerate from "
    "the tracked files alone, byte for byte (`tests/test_budget_analysis.py`), and so does this page "
    "(`tests/test_analysis.py`). `python analysis/compact_runs.py --restore DIR` writes a folder's map files "
    "and carried outputs back before a rerun (a command that reads `DIR/menu/menu.json` or "
    "`DIR/maps/...` needs it).",
    "",
]


# The converged proofs (issue 42), README's table: (folder, what was trained, the rows shown and how to name them).
CONVERGED = (
    ("proof_resnet20_converged", "resnet20, all of CIFAR-10, 50 epochs (top-1 %)",
     {"chosen_0.08": "default menu's map at 0.08×", "pool2": "the paper's 2×2 (exact BatchNorm inputs)",
      "adaptive_0.08": "the 0.08× map re-chosen every 10 epochs (`adaptive.every`)",
      "budget_0.45": "`memory_budget=` at 0.45× stock's step peak"}),
    ("proof_lm_converged", "tiny Llama, 3,000 steps (val_ppl)",
     {"chosen_0.25": "default menu's map at 0.25×", "chosen_0.12": "default menu's map at 0.12× (codes)",
      "recompute_1.10x_0.12": "0.12×, layer 0 recomputed (float32 inside its rerun)",
      "recompute_int8_1.10x_0.12": "0.12×, layer 0 recomputed, int8 inside its rerun",
      "recompute_int8_1.15x_0.12": "0.12×, layers 0-1 recomputed, int8 inside"}),
)
README_BEGIN = "<!-- converged: written by analysis/make_results.py from the proofs' summary.json -->"
README_END = "<!-- /converged -->"


def converged_table(results: Path, base: Path) -> list[str]:
    """The converged proofs' rows (``CONVERGED``) from their summary.json, links relative to ``base``:
    saved bytes, step peak, metric over the seeds run so far, paired difference to stock."""
    lines = ["| trained | configuration | saved bytes | step peak | result, mean ± std (seeds) | vs stock, paired (95% CI) |",
             "|---|---|---:|---:|---:|---|"]
    pending = []
    for folder, trained, shown in CONVERGED:
        path = results / folder / "summary.json"
        if not path.is_file():
            pending.append(f"{trained}: not published yet")
            continue
        summary = json.loads(path.read_text())
        rows = {r["config"]: r for budget in summary["budgets"].values() for r in budget["rows"]}
        stock, percent = summary["stock"], summary["layout"]["lower_is_better"]
        f = ".3f" if percent else ".2f"  # a perplexity near 3 moves in its third digit
        link = f"[{trained}]({rel(results / folder / 'summary.md', base)}); stock {stock['mean']:{f}} ± {stock['std']:{f}} ({len(stock['seeds'])})"
        missing = [config for config in shown if config not in rows]
        if missing:
            pending.append(f"{trained}: {', '.join(f'`{c}`' for c in missing)} still training")
        for config, label in shown.items():
            if config not in rows:
                continue
            r, vs = rows[config], rows[config]["vs_stock"]
            std = f" ± {r['std']:{f}}" if len(r["seeds"]) > 1 else ""
            lo, hi = vs["ci95"]
            n = len(vs["seeds"])  # two seeds' bootstrap interval is just their range: say so
            ci = (f", CI [{lo:+{f}}, {hi:+{f}}]" if n > 2 else f", the two seeds' range [{lo:+{f}}, {hi:+{f}}]" if n == 2
                  else "; one seed, no CI")
            diff = f"{vs['rel_pct']:+.1f}% ({vs['mean_diff']:+{f}}{ci})" if percent else f"{vs['mean_diff']:+.2f} pt{ci}"
            lines.append(f"| {link} | {label} | {r['ratio']:.3f}× | {r['step_peak_ratio']:.3f}× | {r['mean']:{f}}{std} "
                         f"({len(r['seeds'])}) | {diff} |")
            link = ""
    return lines + ([""] + [f"Pending: {'; '.join(pending)}."] if pending else [])


def write_readme_table(readme: Path, results: Path) -> None:
    """README.md's converged table, between its markers (a README without them is left alone)."""
    if not readme.is_file():
        return
    text = readme.read_text()
    if README_BEGIN not in text:
        return
    head, _, rest = text.partition(README_BEGIN)
    _, _, tail = rest.partition(README_END)
    readme.write_text("\n".join([head + README_BEGIN, *converged_table(results, readme.parent), README_END]) + tail)


def index_section() -> list[str]:
    """One table per kind of study: what it measured, its evidence and what made it."""
    def table(rows: list[tuple[str, list[tuple[str, str]], str]]) -> list[str]:
        return ["| study | evidence | made by |", "|---|---|---|",
                *(f"| {what} | {', '.join(f'[{label}]({path})' for label, path in links)} | {made} |"
                  for what, links, made in rows)]
    proofs = [(what, [(f"{folder}/summary.md", f"{folder}/summary.md")], f"runs: {runs}; summary: {summary}")
              for folder, what, runs, summary in PROOFS]
    return ["Every measured result, with the file it comes from and the command that made it. The sections "
            "after this index show the generated tables and embed the proofs' summaries.", "",
            "### Memory and speed", "", *table(MEASURES), "",
            "### Accuracy", "", *table(STUDIES), "",
            "### Accuracy at a memory budget: the proofs (paired seeds) and criterion checks", "", *table(proofs), ""]


def build(args: argparse.Namespace) -> str:
    out = Path(args.out).resolve()
    docs = out.parent
    results = Path(args.results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    mem_lines, ours = memory_section(Path(args.memory_csv).resolve(), results, docs)
    cifar_lines, cifar_rows = cifar_section(Path(args.cifar).resolve(), results, docs)

    def saved(cfg: str) -> str:
        return f"{100 * (1 - ours[cfg]):.0f}%" if cfg in ours else "(pending)"

    def ratio(cfg: str) -> str:
        return f"{ours[cfg]:.2f}" if cfg in ours else "pending"

    def ours_pct(cfg: str) -> str:
        return f"{100 * (ours[cfg] - 1):+.1f}% (ratio {ours[cfg]:.3f})" if cfg in ours else "pending"

    base = next((r for r in cifar_rows if r.get("map") == "none" and r.get("top1") is not None), None)
    p2 = next((r for r in cifar_rows if r.get("map") == "pool2" and r.get("top1") is not None), None)
    gap = (f"{100 * (p2['top1'] - base['top1']):+.2f} points top-1 (resnet20, CIFAR-10, {p2['epochs']} epochs, "
           f"{'final' if p2.get('complete') and base.get('complete') else 'partial'})"
           if base and p2 else "pending (CIFAR-10 multirun not finished)")
    L = [
        "# Results: lessmem vs the paper",
        "",
        "<!-- Generated by `python analysis/make_results.py`; edit that script, not this file. -->",
        "",
        "The one index of the measured results. Regenerate it from the committed evidence with one command: "
        "`python analysis/make_results.py`.",
        "",
        f"**Machine.** Every figure was measured on the development machine: {MACHINE}, against stock "
        "PyTorch on the same model and batch. Two measures. **Saved-for-backward bytes**: what the autograd "
        "graph keeps alive after the forward pass beyond what the caller holds anyway (parameters, buffers and "
        "the input batch are not counted; a saved view counts the bytes it spans; counted by "
        "`lessmem.measure_memory`) — *not* CUDA peak memory. **Whole-step peak**: the paper's measure, "
        "everything alive during one forward + backward + optimizer step; on the CPU, the tensor bytes of "
        "torch's allocator ([results/peak_memory.md](results/peak_memory.md); every `lessmem-train` run "
        "records it as `step_peak_ratio`). CUDA figures (`benchmarks/gpu.py`) are **pending a GPU**.",
        "",
        "## Index",
        "",
        *index_section(),
        "## Paper vs ours (ResNet18)",
        "",
        "| | paper (Barley & Fröning, arXiv 2409.11902) | ours |",
        "|---|---|---|",
        f"| memory, 2×2 | −{100 * PAPER['2x2']['peak_reduction']:.0f}% total peak GPU memory | "
        f"{ours_pct('2x2')} saved-for-backward bytes |",
        f"| memory, 4×4 | −{100 * PAPER['4x4']['peak_reduction']:.0f}% total peak GPU memory | "
        f"{ours_pct('4x4')} saved-for-backward bytes |",
        f"| accuracy, 2×2 | within {100 * PAPER['top1_gap_2x2']:.1f}% top-1 of baseline (after a longer "
        f"schedule) | {gap} |",
        "",
        "Baselines: paper — the uncompressed network's peak GPU memory; ours — stock PyTorch ResNet18, "
        "same batch (32, 224×224, fp32), saved-for-backward bytes.",
        "",
        "### What differs from the paper, and why",
        "",
        "- **Quantity measured.** The paper reports total peak GPU memory: weights, gradients, optimizer "
        "state, cuDNN workspace and allocator overhead on top of activations. Ours counts only the tensors "
        "kept for backward. Those fixed costs do not shrink, so the same compression gives a smaller "
        "*relative* reduction of the total peak: our larger percentages are expected, not a contradiction.",
        "- **More than conv inputs is compressed.** lessmem also stores ReLU outputs as 1-bit masks and "
        "max-pool indices as uint8 (\"exact error propagation\" companions), so even k=1 saves "
        f"{saved('k=1')} on ResNet18. Pooling conv inputs only (`naive 2x2` row) "
        f"*increases* saved bytes (ratio {ratio('naive 2x2')}), because "
        "ReLU/BN still keep their full-size tensors and the pooled copy is extra.",
        "- **Optional approximate storage** (`+ bf16 BN`, `+ int8 BN` rows) goes beyond the paper and "
        "changes gradients; the headline 2×2 / 4×4 rows keep BatchNorm inputs exact.",
        "- **Accuracy.** The paper trains to convergence with a longer schedule on GPUs; here a 4-epoch "
        "resnet20/CIFAR-10 CPU run (and a 1-epoch ViT smoke run) — enough to show training works and to "
        "see early-training gaps, not to confirm the 1.3% figure.",
        "- **Weights.** Memory is measured on randomly initialised models (saved bytes do not depend on "
        "the weights); the resnet18 sensitivity and fidelity search below use random-init gradients as a "
        "proxy, the proofs' menus are measured after stock warm-up steps.",
        "",
        "## Saved-for-backward memory: stock vs lessmem",
        "",
        *mem_lines,
        "### Per block: resnet18, stock vs 2×2",
        "",
        *per_layer_section(results, docs, not args.no_measure, args.per_layer_batch),
        "## CIFAR-10: resnet20 baseline vs pool2 vs pool4 (CPU)",
        "",
        *cifar_lines,
        "## Layer sensitivity and map search (resnet18, CIFAR stem)",
        "",
        *search_section(results, docs),
        "## Accuracy: sensitivity-chosen maps vs uniform 2×2 at the same bytes (resnet20, CIFAR-10)",
        "",
        *proof_section(results / "proof", docs),
        "## Maps at a memory budget: the compressor menu and its criterion (resnet20, CIFAR-10)",
        "",
        *budget_section(results, docs),
        "## At convergence: the converged proofs (issue 42)",
        "",
        *converged_table(results, docs),
        "",
        "## Language model at 0.25x saved bytes: unbiased codes and the menu's map (tiny Llama, 8 paired seeds)",
        "",
        *lm_proof_section(results / "proof_tiny_llama", docs),
        "## Language model: lm_quick at its tuned learning rate, at 0.5x and 0.12x, and the criterion check (tiny Llama)",
        "",
        *lm_budget_section(results, docs),
        "## Vision transformers",
        "",
        "Baseline: the stock model (same batch). vit_b_16: batch 8 (then batch 32), 224×224, random init "
        "(`python benchmarks/memory.py --models vit_b_16 --batch 8`). vit_tiny_cifar (the last table): 1 epoch on a "
        "3000-image CIFAR-10 subset, 1000 test images — smoke scale, top-1 differences are within run-to-run noise.",
        "",
        *embed_table(results / "vit_memory.md", docs),
        "## Result folders: what git keeps",
        "",
        *FOLDERS,
        "## Tooling: the same tables for any sweep or search",
        "",
        "- `python analysis/report.py <sweep-or-search-dir>`: `table.md`/`table.csv` (one row per "
        "configuration: map, kernels, saved bytes, CUDA peak when on a GPU, ratio to stock, top-1/top-5, "
        "train time), `memory_vs_accuracy.png` (Pareto front in red), `accuracy_curves.png`. Reads "
        "`metrics.json`/`metrics.jsonl` or a search's `study.journal` (Optuna) / `trials.csv`; no W&B needed.",
        "- `python analysis/per_layer.py --model resnet18 --map '*=4'`: per-block stock vs compressed bars.",
        "- W&B (offline by default; `wandb sync <dir>/wandb/offline-run-*` later): every run with "
        "`logger=wandb` logs a `tradeoff/table` row, a memory-vs-accuracy scatter and its accuracy-curve "
        "figure at the end; `python analysis/wandb_log.py <sweep-or-search-dir>` logs the whole table, "
        "scatter, Pareto table/line and figure as one run; for Hydra multiruns add "
        "`+hydra.callbacks.tradeoff._target_=lessmem.reporting.WandbSweepCallback` to do that (and "
        "`<sweep>/report/`) automatically at the end.",
        "",
        "## Pending",
        "",
        *([f"- {', '.join(ours['_small_batch'])} at batch 32 (OOM-killed here; measured at a smaller batch)."]
          if ours.get("_small_batch") else []),
        "- CUDA peak memory (total, as the paper reports) for every row above: needs a GPU; "
        "`python benchmarks/gpu.py` / `lessmem-train` record it when run on CUDA.",
        "- ResNet18 accuracy with the paper's longer schedule (`experiment=paper_resnet18`).",
    ]
    if any(not r.get("complete", True) for r in cifar_rows):
        L.append(f"- CIFAR-10 resnet20 runs (`{rel(Path(args.cifar).resolve(), REPO)}`) were still running when "
                 "this file was generated: rerun `python analysis/make_results.py` when they finish.")
    if not cifar_rows:
        L.append(f"- CIFAR-10 resnet20 runs (`{rel(Path(args.cifar).resolve(), REPO)}`): not finished when generated.")
    text = "\n".join(L) + "\n"
    out.write_text(text)
    write_readme_table(docs.parent / "README.md", results)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "docs" / "RESULTS.md"))
    p.add_argument("--results", default=str(REPO / "docs" / "results"), help="docs/results dir (PNGs go here)")
    p.add_argument("--memory-csv", default=str(REPO / "docs" / "results" / "memory.csv"))
    p.add_argument("--cifar", default=str(REPO / CIFAR_DIR))
    p.add_argument("--per-layer-batch", type=int, default=32)
    p.add_argument("--no-measure", action="store_true", help="never run measure_memory (use cached CSVs)")
    args = p.parse_args(argv)
    build(args)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
