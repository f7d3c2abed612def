"""A study's report: ``trials.csv``, ``pareto.csv``, ``pareto.md``, ``summary.json``, the
Pareto maps as YAML files (``best_maps/``) and ``pareto.png``."""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig

from lessmem.sensitivity import SensitivityResult, write_map_yaml
from lessmem.reporting import pareto_front
from lessmem.search.plot import plot_pareto
from lessmem.search.trial_rows import pruned_rows, trial_rows

CSV_FIELDS = ["trial", "seed", "state", "pruned_at_epoch", "conv_input_bytes", "score", "mean_cosine",
              "feasible", "params", "config"]


def write_report(study: optuna.Study, result: SensitivityResult, sweep: DictConfig, out_dir: Path) -> dict[str, Any]:
    rows = trial_rows(study)
    if not rows:
        raise RuntimeError(f"study {sweep.study_name} has no complete trial")
    front = pareto_front(rows, mem="conv_input_bytes", acc="score")
    base_bytes = result.baseline_bytes()
    pruned = pruned_rows(study)
    all_rows = sorted(rows + pruned, key=lambda r: r["trial"])
    for name, data in (("trials.csv", all_rows), ("pareto.csv", front)):
        with (out_dir / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(data)
    maps_dir = out_dir / "best_maps"
    for r in front:
        write_map_yaml(r["map"], maps_dir / f"trial_{r['trial']:04d}.yaml",
                       name=f"{sweep.study_name}_t{r['trial']}",
                       comment=f"Pareto map of {sweep.study_name}, trial {r['trial']}: conv-input bytes "
                               f"{r['conv_input_bytes']} ({r['conv_input_bytes'] / base_bytes:.3f} of all-1), "
                               f"{sweep.objective} score {r['score']:.4f}")
    seeds = {r["seed"]: r for r in rows if r["seed"]}
    beats = _dominating(front, seeds.get("uniform_2"))
    summary = {
        "study": sweep.study_name, "objective": sweep.objective, "mode": sweep.mode,
        "complete_trials": len(rows), "pruned_trials": len(pruned),
        "pruner": str(sweep.pruner.name), "baseline_conv_input_bytes": base_bytes,
        "seeds": {k: {"conv_input_bytes": v["conv_input_bytes"], "score": v["score"]} for k, v in seeds.items()},
        "pareto": [{"trial": r["trial"], "conv_input_bytes": r["conv_input_bytes"], "score": r["score"],
                    "params": json.loads(r["params"])} for r in front],
        "beats_uniform_2": [r["trial"] for r in beats],
    }
    if sweep.mode == "budget":
        feasible = [r for r in rows if r["feasible"]]
        summary["best_feasible"] = max(feasible, key=lambda r: r["score"])["trial"] if feasible else None
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "pareto.md").write_text(_markdown(front, seeds, beats, base_bytes, sweep, pruned))
    plot_pareto(rows, front, out_dir / "pareto.png", sweep, pruned)
    return summary


def _dominating(front: list[dict[str, Any]], ref: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Front maps with fewer bytes than ``ref`` and at least its score."""
    if ref is None:
        return []
    return [r for r in front if r["conv_input_bytes"] < ref["conv_input_bytes"] and r["score"] >= ref["score"]]


def _markdown(front: Sequence[Mapping[str, Any]], seeds: Mapping[str, Mapping[str, Any]],
              beats: Sequence[Mapping[str, Any]], base_bytes: int, sweep: DictConfig,
              pruned: Sequence[Mapping[str, Any]] = ()) -> str:
    label = "mean grad cosine" if sweep.objective == "fidelity" else sweep.score_key
    lines = [f"# Pareto front: {sweep.study_name}", "",
             f"objective: {sweep.objective} ({label}), memory: conv-input bytes kept for backward "
             f"(all-1 = {base_bytes:,d} B)", "",
             "| trial | seed | conv-input bytes | of all-1 | " + label + " | kernels |", "|---|---|---|---|---|---|"]
    for r in front:
        lines.append(f"| {r['trial']} | {r['seed']} | {r['conv_input_bytes']:,d} | "
                     f"{r['conv_input_bytes'] / base_bytes:.3f} | {r['score']:.4f} | `{r['params']}` |")
    lines += ["", "Seeds (uniform maps and the greedy sensitivity map):", ""]
    for name, r in sorted(seeds.items()):
        lines.append(f"- {name}: {r['conv_input_bytes']:,d} B ({r['conv_input_bytes'] / base_bytes:.3f}), "
                     f"{label} {r['score']:.4f}")
    lines += ["", f"Pareto maps with fewer bytes than uniform 2x2 at equal or better {label}: "
              + (", ".join(f"trial {r['trial']}" for r in beats) or "none"), ""]
    if pruned:
        lines += [f"Pruned trials ({sweep.pruner.name} pruner): " + ", ".join(
            f"trial {r['trial']} after epoch {r['pruned_at_epoch']} ({label} {r['score']:.4f})"
            if r["score"] != "" else f"trial {r['trial']}" for r in pruned), ""]
    return "\n".join(lines)
