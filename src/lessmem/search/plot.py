"""``pareto.png``: a study's trials, its Pareto front, seeds and pruned trials."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lessmem.reporting import MiB, pyplot, save_figure


def plot_pareto(rows: Sequence[Mapping[str, Any]], front: Sequence[Mapping[str, Any]], path: Path,
                sweep: DictConfig, pruned: Sequence[Mapping[str, Any]] = ()) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.scatter([r["conv_input_bytes"] / MiB for r in rows], [r["score"] for r in rows], s=14,
               color="0.6", label="trials")
    ax.plot([r["conv_input_bytes"] / MiB for r in front], [r["score"] for r in front], "o-",
            color="tab:red", ms=5, label="Pareto front")
    shown = [r for r in pruned if r["score"] != "" and r["conv_input_bytes"] != ""]
    if shown:
        ax.scatter([r["conv_input_bytes"] / MiB for r in shown], [r["score"] for r in shown], s=18,
                   marker="x", color="tab:orange", label="pruned (last reported)")
    for r in rows:
        if r["seed"]:
            ax.scatter(r["conv_input_bytes"] / MiB, r["score"], marker="*", s=120, color="tab:blue", zorder=3)
            ax.annotate(r["seed"], (r["conv_input_bytes"] / MiB, r["score"]), fontsize=7,
                        xytext=(4, -10), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("conv-input bytes kept for backward (MiB, log)")
    ax.set_ylabel("mean weight-gradient cosine" if sweep.objective == "fidelity" else sweep.score_key)
    extra = f" + {len(pruned)} pruned" if pruned else ""
    ax.set_title(f"{sweep.study_name}: {len(rows)} trials{extra}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, dpi=120)
