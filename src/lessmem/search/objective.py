"""One trial: a kernel map from Optuna's suggestions -> a composed config on disk -> (bytes, score).

Objectives (both also minimize the conv-input bytes kept for backward):
  fidelity  maximize the mean weight-gradient cosine over conv layers. No training: it is read
            from the study's SensitivityResult. Valid because the input gradient is exact under
            compression, so each layer's output gradient, and hence its compressed weight
            gradient, does not depend on the other layers' kernels.
  accuracy  maximize validation top-1 after a short ``lessmem.experiment.train.run``.

Memory is counted per layer from the same SensitivityResult (shared inputs stored once, as the
core does); its differences between maps equal those of ``lessmem.core.measure_memory`` (tested).
Every trial writes its composed train config and its map, so it can be re-run as a plain
``lessmem-train`` run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf, open_dict

from lessmem.experiment import run
from lessmem.sensitivity import SensitivityResult, group_layers, write_map_yaml


def param_name(unit: str) -> str:
    """The Optuna parameter of a layer or group's kernel."""
    return f"k:{unit}"


def suggest_map(trial: optuna.Trial, units: Mapping[str, list[str]], kernels: Sequence[int]) -> dict[str, int]:
    kmap: dict[str, int] = {}
    for unit, layers in units.items():
        k = trial.suggest_categorical(param_name(unit), list(kernels))
        kmap.update(dict.fromkeys(layers, int(k)))
    return kmap


def seed_maps(result: SensitivityResult, units: Mapping[str, list[str]], sweep: DictConfig) -> dict[str, dict[str, int]]:
    """Uniform 1/2/4 maps and the greedy sensitivity map, as unit -> kernel params."""
    seeds = {f"uniform_{k}": dict.fromkeys(units, k) for k in (1, 2, 4) if k in sweep.kernels}
    greedy = result.make_map(budget_bytes=float(sweep.seed_sensitivity_budget), groups=sweep.groups)
    seeds["sensitivity"] = {u: greedy[layers[0]] for u, layers in units.items()}
    return seeds


def trial_config(base: DictConfig, kmap: Mapping[str, int], name: str, out_dir: Path) -> DictConfig:
    """The composed train config with the trial's map put into ``compression.map`` (a dict is
    awkward as an override string, so it is set through OmegaConf)."""
    cfg = base.copy()
    with open_dict(cfg):
        cfg.compression.map = {str(k): int(v) for k, v in kmap.items()}
        cfg.compression.map_file = None
        cfg.compression.name = name
        cfg.compression.norm_storage = "native"
        cfg.compression.exact_companions = True
        cfg.out_dir = str(out_dir)
    return cfg


class Objective:
    """One trial: map -> composed config on disk -> (bytes, score)."""

    def __init__(self, sweep: DictConfig, base: DictConfig, result: SensitivityResult, out_dir: Path) -> None:
        self.sweep, self.base, self.result, self.out_dir = sweep, base, result, out_dir
        self.units = group_layers(result.layers, sweep.groups)
        self.budget = result._budget(float(sweep.budget))

    def __call__(self, trial: optuna.Trial) -> float | tuple[float, float]:
        kmap = suggest_map(trial, self.units, list(self.sweep.kernels))
        trial_dir = self.out_dir / "trials" / f"{trial.number:04d}"
        cfg = trial_config(self.base, kmap, f"{self.sweep.study_name}_t{trial.number}", trial_dir)
        trial_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, trial_dir / "config.yaml")
        map_path = write_map_yaml(kmap, trial_dir / "compression.yaml", name=cfg.compression.name)
        overrides = [*self.sweep.base_overrides, f"compression.map_file={map_path}", f"out_dir={trial_dir / 'train'}"]
        trial.set_user_attr("map", kmap)
        trial.set_user_attr("config", str(trial_dir / "config.yaml"))
        trial.set_user_attr("rerun", "lessmem-train " + " ".join(overrides))
        memory = self.result.saved_bytes(kmap)
        trial.set_user_attr("conv_input_bytes", memory)
        trial.set_user_attr("mean_cosine", self.result.mean_cosine(kmap))
        if self.sweep.objective == "fidelity":
            score = self.result.mean_cosine(kmap)
        else:
            score = self._train(cfg, trial, trial_dir)
        trial.set_user_attr("score", score)
        constraint = float(memory - self.budget) if self.budget is not None else 0.0
        trial.set_user_attr("constraint", [constraint])
        if self.sweep.mode == "budget":
            trial.set_constraint("memory", constraint)
        return (float(memory), score) if self.sweep.mode == "pareto" else score

    def _train(self, cfg: DictConfig, trial: optuna.Trial, trial_dir: Path) -> float:
        with open_dict(cfg):
            cfg.out_dir = str(trial_dir / "train")
        return train_trial(cfg, trial, str(self.sweep.score_key))


def train_trial(cfg: DictConfig, trial: optuna.Trial, score_key: str) -> float:
    """Train ``cfg`` reporting per-epoch val top-1 to ``trial`` (pruned when the pruner says so);
    returns ``metrics[score_key]``."""
    best = [float("-inf")]
    epochs = int(cfg.epochs)

    def report(epoch: int, record: dict[str, Any]) -> None:
        # Intermediate value: the score so far (best_* keys: best epoch so far).
        value = float(record["val_top1"] if "top1" in score_key else record["val_top5"])
        best[0] = max(best[0], value)
        trial.report(best[0] if score_key.startswith("best") else value, epoch)
        # After the last epoch there is nothing left to save: the trial completes with its score.
        if epoch < epochs and trial.should_prune():
            trial.set_user_attr("pruned_at_epoch", epoch)
            raise optuna.TrialPruned(f"pruned after epoch {epoch} (val_top1 {value:.4f})")

    metrics = run(cfg, on_epoch_end=report)
    trial.set_user_attr("measured_saved_bytes", metrics.get("saved_bytes"))
    trial.set_user_attr("stock_saved_bytes", metrics.get("stock_saved_bytes"))
    return float(metrics[score_key])
