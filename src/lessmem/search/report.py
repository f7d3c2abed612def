"""A search's report: ``trials.csv``, ``report.md``, ``summary.json``, the best map as
``best_map.yaml`` and ``search.png`` (each trial's score against its criterion value)."""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig

from lessmem.reporting import pyplot, save_figure

FIELDS = ["trial", "seed", "state", "pruned_at_epoch", "diverged_at", "saved_bytes", "ratio", "criterion", "score", "same_as",
          "map_file"]


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """Complete, diverged (training stopped at a non-finite loss or gradient; scored as it stopped)
    and pruned trials (a pruned one's score: its last reported value)."""
    rows = []
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    for t in study.get_trials(deepcopy=False, states=states):
        a = t.user_attrs
        pruned = t.state == optuna.trial.TrialState.PRUNED
        last, value = last_report(t)
        score = value if pruned else a.get("score")
        state = "pruned" if pruned else "diverged" if "diverged" in a else "complete"
        rows.append({"trial": t.number, "seed": a.get("seed", ""), "state": state,
                     "pruned_at_epoch": last if pruned and last is not None else "",
                     "diverged_at": f"epoch {d['epoch']}, step {d['step']}" if (d := a.get("diverged")) else "",
                     "saved_bytes": a.get("saved_bytes"), "ratio": a.get("ratio"), "criterion": a.get("criterion"),
                     "score": score,
                     "same_as": a.get("same_as", ""), "map_file": a.get("map_file", "")})
    return sorted(rows, key=lambda r: r["trial"])


def write_report(study: optuna.Study, search: DictConfig) -> dict[str, Any]:
    out_dir = Path(search.out_dir)
    rows = trial_rows(study)
    complete = [r for r in rows if r["state"] == "complete"]
    if not complete:
        diverged = sum(r["state"] == "diverged" for r in rows)
        raise RuntimeError(f"study {search.study_name} has no complete trial"
                           + (f" ({diverged} diverged)" if diverged else ""))
    with (out_dir / "trials.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    sign = -1.0 if search.direction == "minimize" else 1.0
    best = max(complete, key=lambda r: sign * r["score"])
    seed = next((r for r in complete if r["seed"] == "knapsack"), None)
    shutil.copyfile(best["map_file"], out_dir / "best_map.yaml")
    summary = {
        "study": search.study_name, "score_key": search.score_key,
        "budget": float(search.budget), "criterion": search.criterion, "pruner": str(search.pruner.name),
        "complete_trials": len(complete), "pruned_trials": sum(r["state"] == "pruned" for r in rows),
        "diverged_trials": sum(r["state"] == "diverged" for r in rows),
        "distinct_maps_trained": len({r["map_file"] for r in complete if r["same_as"] == ""}),
        "best": {k: best[k] for k in ("trial", "score", "ratio", "criterion")},
        "best_map": str(out_dir / "best_map.yaml"),
        "knapsack": {k: seed[k] for k in ("trial", "score", "ratio", "criterion")} if seed else None,
        "best_is_knapsack": bool(seed and best["trial"] == seed["trial"]),
        "report": str(out_dir / "report.md"),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    (out_dir / "report.md").write_text(_markdown(rows, summary, search))
    plot_search(rows, out_dir / "search.png", search)
    return summary


def last_report(t: optuna.trial.FrozenTrial) -> tuple[int | None, float | None]:
    """(epoch, value) of the trial's last intermediate report; (None, None) before any."""
    steps = t.intermediate_values
    if not steps:
        return None, None
    last = max(steps)
    return last, steps[last]


def _markdown(rows: Sequence[dict[str, Any]], summary: dict[str, Any], search: DictConfig) -> str:
    lines = [f"# Search: {search.study_name}", "",
             f"Maps at <= {float(search.budget):g}x stock saved bytes, the knapsack over the whole menu on "
             f"`{search.criterion}` with per-unit weights from Optuna (TPE); score: `{search.score_key}` of a short "
             f"training run ({search.pruner.name} pruning). {summary['complete_trials']} complete trials "
             f"({summary['distinct_maps_trained']} distinct maps trained), {summary['pruned_trials']} pruned"
             + (f", {summary['diverged_trials']} diverged (never the best)" if summary["diverged_trials"] else "") + ".", "",
             f"Best: trial {summary['best']['trial']} ({summary['best']['score']:.4f}); "
             + (f"the criterion's own map (trial {summary['knapsack']['trial']}): {summary['knapsack']['score']:.4f}."
                if summary["knapsack"] else "the criterion's own map did not complete."), "",
             "| trial | seed | state | saved ratio | criterion | score | same map as |", "|---|---|---|---:|---:|---:|---|"]
    sign = -1.0 if search.direction == "minimize" else 1.0  # best first, unscored last
    for r in sorted(rows, key=lambda r: (r["score"] is None, -sign * (r["score"] or 0.0))):
        score = "" if r["score"] is None else f"{r['score']:.4f}"
        state = r["state"] + (f" (epoch {r['pruned_at_epoch']})" if r["pruned_at_epoch"] != "" else "")
        state += f" ({r['diverged_at']})" if r["diverged_at"] else ""
        lines.append(f"| {r['trial']} | {r['seed']} | {state} | {r['ratio']:.3f} | {r['criterion']:.4g} | "
                     f"{score} | {r['same_as']} |")
    return "\n".join(lines) + "\n"


def plot_search(rows: Sequence[dict[str, Any]], path: Path, search: DictConfig) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    labels = {"complete": "complete", "pruned": "pruned (last reported)", "diverged": "diverged (as it stopped)"}
    for state, marker, color in (("complete", "o", "tab:blue"), ("pruned", "x", "tab:orange"),
                                 ("diverged", "v", "tab:gray")):
        shown = [r for r in rows if r["state"] == state and r["score"] is not None]
        if not shown:
            continue
        label = labels[state]
        ax.scatter([r["criterion"] for r in shown], [r["score"] for r in shown], marker=marker, color=color,
                   s=24, label=label)
    for r in rows:
        if r["seed"] and r["score"] is not None:
            ax.scatter(r["criterion"], r["score"], marker="*", s=140, color="tab:red", zorder=3)
            ax.annotate(r["seed"], (r["criterion"], r["score"]), fontsize=7, xytext=(4, -10), textcoords="offset points")
    if search.criterion != "cosine":
        ax.set_xscale("log")
    ax.set_xlabel(f"{search.criterion} of the trial's map")
    ax.set_ylabel(str(search.score_key))
    ax.set_title(f"{search.study_name}: maps at <= {float(search.budget):g}x stock saved bytes", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
