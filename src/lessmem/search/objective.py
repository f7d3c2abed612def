"""Trials of a search: per-layer maps over the menu (pooling x storage for conv inputs, storages
for BatchNorm / activation inputs; kernel-only with the ``menu=kernels`` group) at a budget of
total saved bytes, scored by a short training run.

A random per-layer choice almost never fits a tight budget, so Optuna does not pick options
directly: it picks one log-weight per unit (a conv group reading one tensor, a BatchNorm or an
activation input), and the trial's map is the menu knapsack's answer with each unit's criterion
values scaled by ``exp(weight)``. Every trial therefore fits the budget and spends it, and the
search explores which layers the criterion under- or over-rates. All weights 0 is the
criterion's own map (enqueued first, labelled ``knapsack``). A map an earlier trial already
trained is not trained again: the trial takes that score (``same_as``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf, open_dict

from lessmem.experiment import run
from lessmem.sensitivity import MenuResult, ScoredPlan

WEIGHT_RANGE = (-2.0, 2.0)  # a unit's criterion scaled by 0.14x .. 7.4x


def weight_param(unit: str) -> str:
    """The Optuna parameter of a unit's log-weight."""
    return f"w:{unit}"


class Objective:
    """One trial: unit weights -> the knapsack's map at the budget -> map file -> trained score."""

    def __init__(self, search: DictConfig, base: DictConfig, menu: MenuResult) -> None:
        self.search, self.base, self.menu, self.out_dir = search, base, menu, Path(search.out_dir)
        self.units = menu.unit_items()
        self.budget = float(search.budget)
        self.criterion = str(search.criterion)

    def seeds(self) -> dict[str, dict[str, float]]:
        """The criterion's own map (every weight 0), as Optuna params."""
        return {"knapsack": {weight_param(u): 0.0 for u in self.units}}

    def choice(self, weights: dict[str, float]) -> ScoredPlan:
        per_item = {name: math.exp(weights[u]) for u, names in self.units.items() for name in names}
        return self.menu.make_map(self.budget, self.criterion, weights=per_item)

    def __call__(self, trial: optuna.Trial) -> float:
        weights = {u: trial.suggest_float(weight_param(u), *WEIGHT_RANGE) for u in self.units}
        choice = self.choice(weights)
        key = choice.plan.digest  # equal plans, equal keys: the trial-reuse check
        name = f"{self.search.study_name}_t{trial.number}"
        trial_dir = self.out_dir / "trials" / f"{trial.number:04d}"
        map_path = choice.plan.replace(name=name).write(
            trial_dir / "compression.yaml", comment=f"{self.search.study_name} trial {trial.number}: predicted saved bytes "
                                                    f"{choice.score['ratio']:.3f}x stock, {self.criterion} "
                                                    f"{choice.score[self.criterion]:.4g}")
        cfg = self.base.copy()
        with open_dict(cfg):
            cfg.compression.map_file = str(map_path)
            cfg.out_dir = str(trial_dir / "train")
        OmegaConf.save(cfg, trial_dir / "config.yaml")
        overrides = [*self.search.base_overrides, f"compression.map_file={map_path}", f"out_dir={trial_dir / 'train'}"]
        trial.set_user_attr("map_key", key)
        trial.set_user_attr("map_file", str(map_path))
        trial.set_user_attr("config", str(trial_dir / "config.yaml"))
        trial.set_user_attr("rerun", "lessmem-train " + " ".join(overrides))
        trial.set_user_attr("saved_bytes", choice.score["bytes"])
        trial.set_user_attr("ratio", choice.score["ratio"])
        trial.set_user_attr("criterion", choice.score[self.criterion])
        earlier = self._trained(trial.study, key)
        if earlier is not None:
            trial.set_user_attr("same_as", earlier.number)
            if "diverged" in earlier.user_attrs:
                trial.set_user_attr("diverged", earlier.user_attrs["diverged"])
            score = float(earlier.value)
        else:
            score = train_trial(cfg, trial, str(self.search.score_key), self.search.direction == "minimize")
        trial.set_user_attr("score", score)
        return score

    @staticmethod
    def _trained(study: optuna.Study, key: str) -> optuna.trial.FrozenTrial | None:
        done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        return next((t for t in done if t.user_attrs.get("map_key") == key and "same_as" not in t.user_attrs), None)


def train_trial(cfg: DictConfig, trial: optuna.Trial, score_key: str, minimize: bool = False) -> float:
    """Train ``cfg`` reporting the per-epoch validation value of ``score_key``'s metric
    (``best_top1`` / ``final_top1``: ``val_top1``; ``final_val_ppl``: ``val_ppl``) to ``trial``
    (pruned when the pruner says so); returns ``metrics[score_key]``."""
    metric = score_key.removeprefix("best_").removeprefix("final_")
    metric = metric if metric.startswith("val_") else f"val_{metric}"
    better = min if minimize else max
    best: list[float] = []
    epochs = int(cfg.epochs)

    def report(epoch: int, record: dict[str, Any]) -> None:
        # Intermediate value: the score so far (best_* keys: best epoch so far).
        value = float(record[metric])
        best[:] = [better([*best, value])]
        trial.report(best[0] if score_key.startswith("best") else value, epoch)
        # After the last epoch there is nothing left to save: the trial completes with its score.
        if epoch < epochs and trial.should_prune():
            trial.set_user_attr("pruned_at_epoch", epoch)
            raise optuna.TrialPruned(f"pruned after epoch {epoch} ({metric} {value:.4f})")

    metrics = run(cfg, on_epoch_end=report)
    if metrics.get("diverged"):  # scored as it stopped; the report never picks it as the best
        trial.set_user_attr("diverged", metrics["diverged"])
    trial.set_user_attr("measured_saved_bytes", metrics.get("saved_bytes"))
    trial.set_user_attr("stock_saved_bytes", metrics.get("stock_saved_bytes"))
    return float(metrics[score_key])
