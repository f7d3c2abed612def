"""Optuna search over per-layer (or per-group) compression maps.

    lessmem-search --config sweeps/fidelity_resnet18_cifar.yaml [key=value ...]

Objectives (both also minimize the conv-input bytes kept for backward):
  fidelity  maximize the mean weight-gradient cosine over conv layers. No training: it is read
            from one SensitivityResult computed once on fixed real batches. Valid because the
            input gradient is exact under compression, so each layer's output gradient, and hence
            its compressed weight gradient, does not depend on the other layers' kernels.
  accuracy  maximize validation top-1 after a short ``lessmem.train.run``.

Memory is counted per layer from the same SensitivityResult (shared inputs stored once, as the
core does); its differences between maps equal those of ``lessmem.measure_memory`` (tested).

The study lives in an Optuna journal file: rerunning the same command resumes it and runs only the
trials still missing (``n_trials`` counts complete + pruned ones). Every trial writes its composed
train config and its map, so it can be re-run as a plain ``lessmem-train`` run.

Many workers (``--worker``, docs/scale_out.md): start the same command any number of times, on
any hosts that reach the storage (``storage``: a journal file on a shared file system, or an
RDB URL such as ``postgresql://user:pw@host/db``, ``mysql+pymysql://...``, ``sqlite:///f.db``).
Workers share the fixed total: together they finish exactly ``n_trials`` (a trial that would
exceed it is dropped before it runs). RDB storages heartbeat every trial; a trial of a killed
worker goes stale after ``grace_s`` and is retried (``RetryFailedTrialCallback``). Journal
storages have no heartbeat: a worker fails only RUNNING trials whose process is gone on its
own host, never one that another live worker runs.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import random
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig, OmegaConf, open_dict

from lessmem.experiment import build_model_from_cfg, compose_config, fixed_batches, load_checkpoint
from lessmem.layer_sensitivity import SensitivityResult, group_layers, sensitivity, write_map_yaml

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "study_name": "lessmem_search",
    "objective": "fidelity",        # fidelity | accuracy
    "mode": "pareto",               # pareto: NSGA-II on (bytes, score) | budget: max score s.t. bytes
    "n_trials": 50,
    "seed": 0,
    "kernels": [1, 2, 4, 8],
    "groups": None,                 # fnmatch patterns, one kernel per pattern; None: per layer
    "budget": 0.25,                 # mode=budget: fraction of all-k=1 conv-input bytes (bytes if > 1)
    "population_size": 20,          # NSGA-II
    "seed_sensitivity_budget": 0.25,  # budget of the greedy sensitivity map enqueued as a seed
    "out_dir": "outputs/search/${study_name}",
    "storage": "${out_dir}/study.journal",
    "base_overrides": ["logger=disabled"],
    "score_key": "best_top1",       # accuracy: which metrics.json entry is the score
    "sensitivity": {"batches": 4, "batch_size": 32, "split": "train", "checkpoint": None},
    # Accuracy searches in budget mode: stop poor trials early from their per-epoch val_top1.
    # name: none | median | hyperband (Optuna prunes single-objective studies only).
    "pruner": {"name": "none", "n_startup_trials": 4, "n_warmup_steps": 1,
               "min_resource": 1, "reduction_factor": 3},
    # Shared studies (--worker): RDB heartbeat / stale grace and retries of killed trials;
    # poll_s: how often a worker waits for the last trials other workers are running.
    "heartbeat_s": 60,
    "grace_s": 180,
    "max_retry": 2,
    "poll_s": 5.0,
}


# --------------------------------------------------------------------------- config


def load_sweep(path: str | Path | None, overrides: Sequence[str] = ()) -> DictConfig:
    """DEFAULTS <- sweep YAML <- ``key=value`` overrides; interpolations resolved."""
    cfg = OmegaConf.create(DEFAULTS)
    if path is not None:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    unknown = set(cfg) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown sweep keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    if cfg.objective not in ("fidelity", "accuracy"):
        raise ValueError(f"objective must be 'fidelity' or 'accuracy', got {cfg.objective!r}")
    if cfg.mode not in ("pareto", "budget"):
        raise ValueError(f"mode must be 'pareto' or 'budget', got {cfg.mode!r}")
    pruner = str(cfg.pruner.name)
    if pruner not in PRUNERS:
        raise ValueError(f"pruner.name must be one of {list(PRUNERS)}, got {pruner!r}")
    if pruner != "none" and (cfg.mode != "budget" or cfg.objective != "accuracy"):
        raise ValueError("pruning needs objective=accuracy and mode=budget (Optuna cannot prune "
                         "multi-objective studies, and fidelity trials have no epochs)")
    OmegaConf.resolve(cfg)
    return cfg


PRUNERS = ("none", "median", "hyperband")


def make_pruner(pcfg: Mapping[str, Any]) -> optuna.pruners.BasePruner:
    """The sweep's pruner; one step is one training epoch (Hyperband's maximum: the epochs of
    the first trial that completes)."""
    name = str(pcfg["name"])
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=int(pcfg["n_startup_trials"]),
                                           n_warmup_steps=int(pcfg["n_warmup_steps"]))
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=int(pcfg["min_resource"]),
                                              max_resource="auto",
                                              reduction_factor=int(pcfg["reduction_factor"]))
    return optuna.pruners.NopPruner()


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


# --------------------------------------------------------------------------- sensitivity (once)


def study_sensitivity(sweep: DictConfig, base: DictConfig, out_dir: Path) -> SensitivityResult:
    """Computed once per study and cached next to it, so resumed trials see the same numbers."""
    cache = out_dir / "sensitivity" / "sensitivity.json"
    if cache.exists():
        return SensitivityResult.load(cache)
    # Workers started together all compute it (deterministic); the first rename wins.
    final_dir = cache.parent
    tmp_dir = final_dir.with_name(f".sensitivity.{socket.gethostname()}.{os.getpid()}")
    opts = sweep.sensitivity
    import torch

    torch.manual_seed(int(base.get("seed", 0)))
    model = build_model_from_cfg(base)
    if opts.get("checkpoint"):
        load_checkpoint(model, opts.checkpoint)
    batches = fixed_batches(base, int(opts.batches), int(opts.batch_size), str(opts.split), int(base.get("seed", 0)))
    result = sensitivity(model.train(), batches, list(sweep.kernels), progress=True)
    result.meta.update({"model": str(base.model.name), "dataset": str(base.dataset.name),
                        "batch_size": int(opts.batch_size), "weights": str(opts.get("checkpoint") or "random init")})
    result.save(tmp_dir)
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:  # another worker was first
        import shutil

        shutil.rmtree(tmp_dir, ignore_errors=True)
        return SensitivityResult.load(cache)
    return result


# --------------------------------------------------------------------------- study


def _param(unit: str) -> str:
    return f"k:{unit}"


def suggest_map(trial: optuna.Trial, units: Mapping[str, list[str]], kernels: Sequence[int]) -> dict[str, int]:
    kmap: dict[str, int] = {}
    for unit, layers in units.items():
        k = trial.suggest_categorical(_param(unit), list(kernels))
        kmap.update(dict.fromkeys(layers, int(k)))
    return kmap


def seed_maps(result: SensitivityResult, units: Mapping[str, list[str]], sweep: DictConfig) -> dict[str, dict[str, int]]:
    """Uniform 1/2/4 maps and the greedy sensitivity map, as unit -> kernel params."""
    seeds = {f"uniform_{k}": dict.fromkeys(units, k) for k in (1, 2, 4) if k in sweep.kernels}
    greedy = result.make_map(budget_bytes=float(sweep.seed_sensitivity_budget), groups=sweep.groups)
    seeds["sensitivity"] = {u: greedy[layers[0]] for u, layers in units.items()}
    return seeds


def make_storage(sweep: DictConfig, storage: str | Path) -> Any:
    """An RDB URL (``scheme://...``): RDBStorage with heartbeats, killed trials retried; anything
    else: a journal file (lock-protected appends, safe on a shared file system)."""
    if "://" in str(storage):
        from optuna.storages import RDBStorage

        try:  # Optuna >= 4.9; RetryFailedTrialCallback before (same behaviour)
            from optuna.storages import RetryHeartbeatStaleTrialCallback as Retry
        except ImportError:
            from optuna.storages import RetryFailedTrialCallback as Retry
        return RDBStorage(str(storage), heartbeat_interval=int(sweep.heartbeat_s),
                          grace_period=int(sweep.grace_s),
                          heartbeat_stale_trial_callback=Retry(max_retry=int(sweep.max_retry)))
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(storage)))


def open_study(sweep: DictConfig, storage_path: str | Path, worker: bool = False) -> optuna.Study:
    return _open_study(sweep, storage_path, worker)[0]


def _open_study(sweep: DictConfig, storage_path: str | Path, worker: bool = False) -> tuple[optuna.Study, bool]:
    """(study, created here)."""
    storage = make_storage(sweep, storage_path)
    # Offset the sampler seed by the trials already stored: a resumed study must not replay the
    # first generation's random proposals. Workers also differ by host and pid: workers started
    # together would otherwise propose the same maps.
    existing = _n_existing(storage, sweep.study_name)
    seed = int(sweep.seed) + existing
    if worker:
        seed += (hash(socket.gethostname()) + 7919 * os.getpid()) % 1_000_003
    if sweep.mode == "pareto":
        sampler: optuna.samplers.BaseSampler = optuna.samplers.NSGAIISampler(
            population_size=int(sweep.population_size), seed=seed)
        directions = ["minimize", "maximize"]
    else:
        # Constraint values come from trial.set_constraint (Optuna 5; constraints_func is deprecated).
        sampler = optuna.samplers.TPESampler(seed=seed)
        directions = ["maximize"]
    pruner = make_pruner(sweep.pruner)
    try:
        return optuna.create_study(study_name=sweep.study_name, storage=storage, sampler=sampler,
                                   pruner=pruner, directions=directions), True
    except optuna.exceptions.DuplicatedStudyError:
        return optuna.load_study(study_name=sweep.study_name, storage=storage, sampler=sampler,
                                 pruner=pruner), False


def _n_existing(storage: Any, name: str) -> int:
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return 0
    return len(storage.get_all_trials(study_id, deepcopy=False))


def fail_stale(study: optuna.Study) -> list[int]:
    """Trials left RUNNING by an interrupted process: mark them failed and queue their params
    again (they did not finish, so they are not repeats). Assumes one process per study."""
    stale = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING]
    for t in stale:
        study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={k: v for k, v in t.user_attrs.items() if k == "seed"})
    return [t.number for t in stale]


def fail_dead_trials(study: optuna.Study, grace_s: float) -> list[int]:
    """Worker-safe stale handling. Heartbeat storages (RDB): Optuna fails trials whose heartbeat
    stopped and the retry callback queues them again. Journal: fail (and queue again) only
    RUNNING trials whose recorded worker process no longer exists on this host, or with no
    worker recorded ``grace_s`` after their start; trials of live workers and of other hosts are
    left alone (recover those with a worker on their host, or an RDB storage)."""
    from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled

    storage = study._storage
    if isinstance(storage, BaseHeartbeat) and is_heartbeat_enabled(storage):
        optuna.storages.fail_stale_trials(study)
        return []
    host, now, failed = socket.gethostname(), time.time(), []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        owner = t.user_attrs.get("worker")
        if owner:
            dead = owner.get("host") == host and not _pid_alive(int(owner.get("pid", -1)))
        else:
            dead = t.datetime_start is not None and now - t.datetime_start.timestamp() > grace_s
        if not dead:
            continue
        try:
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
        except (RuntimeError, ValueError):  # another worker failed it first
            continue
        study.enqueue_trial(t.params, user_attrs={k: v for k, v in t.user_attrs.items() if k == "seed"})
        failed.append(t.number)
    return failed


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Surplus(Exception):
    """The study already holds n_trials finished or running trials (other workers')."""


class SharedBudget:
    """Wraps the objective for workers: records the worker (host, pid) on the trial, and drops
    the trial before it runs when the other COMPLETE / PRUNED / RUNNING trials already make
    ``n_trials``. Each trial is RUNNING (visible) before it checks, so of trials that check at
    the same time at most the allowed number proceed: the total never exceeds ``n_trials``."""

    def __init__(self, objective: Any, n_trials: int) -> None:
        self.objective, self.n_trials = objective, n_trials

    def __call__(self, trial: optuna.Trial) -> Any:
        trial.set_user_attr("worker", {"host": socket.gethostname(), "pid": os.getpid()})
        counted = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                   optuna.trial.TrialState.RUNNING)
        others = [t for t in trial.study.get_trials(deepcopy=False, states=counted) if t.number != trial.number]
        if len(others) >= self.n_trials:
            fixed = trial.study._storage.get_trial(trial._trial_id).system_attrs.get("fixed_params")
            if fixed:  # a queued map (seed or retry): give it back to the queue
                trial.study.enqueue_trial(fixed, user_attrs={k: v for k, v in trial.user_attrs.items() if k == "seed"})
            trial.set_user_attr("surplus", True)
            raise _Surplus(f"study already has {len(others)} finished or running trials")
        return self.objective(trial)


def optimize_shared(study: optuna.Study, objective: Any, sweep: DictConfig, catch: tuple) -> None:
    """Run trials until the study holds ``n_trials`` finished ones, whoever runs them."""
    n, poll = int(sweep.n_trials), float(sweep.poll_s)
    budget = SharedBudget(objective, n)
    stop = optuna.study.MaxTrialsCallback(n, states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED))
    while True:
        fail_dead_trials(study, float(sweep.grace_s))
        done = n_finished(study)
        running = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)))
        if done >= n:
            return
        if done + running >= n:  # the last trials run elsewhere; take over if they fail
            time.sleep(poll)
            continue
        study.optimize(budget, n_trials=1, catch=(*catch, _Surplus), callbacks=[stop])
        last = study.get_trials(deepcopy=False)[-1] if study.trials else None
        if last is not None and last.user_attrs.get("surplus"):
            time.sleep(random.uniform(0.05, 0.5))  # back off: a simultaneous start dropped


def n_finished(study: optuna.Study) -> int:
    done = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return len(study.get_trials(deepcopy=False, states=done))


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
        from lessmem.experiment.train import run

        with open_dict(cfg):
            cfg.out_dir = str(trial_dir / "train")
        best = [float("-inf")]

        def report(epoch: int, record: dict[str, Any]) -> None:
            # Intermediate value: the score so far (best_* keys: best epoch so far).
            value = float(record["val_top1"] if "top1" in self.sweep.score_key else record["val_top5"])
            best[0] = max(best[0], value)
            trial.report(best[0] if self.sweep.score_key.startswith("best") else value, epoch)
            if trial.should_prune():
                trial.set_user_attr("pruned_at_epoch", epoch)
                raise optuna.TrialPruned(f"pruned after epoch {epoch} (val_top1 {value:.4f})")

        metrics = run(cfg, on_epoch_end=report)
        trial.set_user_attr("measured_saved_bytes", metrics.get("saved_bytes"))
        trial.set_user_attr("stock_saved_bytes", metrics.get("stock_saved_bytes"))
        return float(metrics[self.sweep.score_key])


def run_search(sweep: DictConfig, worker: bool = False) -> dict[str, Any]:
    """Create or resume the study, run the missing trials, write the report; returns a summary.
    ``worker``: one of several processes sharing the study (see the module docstring)."""
    out_dir = Path(sweep.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(sweep, out_dir / "sweep.yaml")
    base = compose_config(list(sweep.base_overrides))
    result = study_sensitivity(sweep, base, out_dir)
    objective = Objective(sweep, base, result, out_dir)
    study, created = _open_study(sweep, sweep.storage, worker)
    stale = fail_dead_trials(study, float(sweep.grace_s)) if worker else fail_stale(study)
    if (created if worker else not study.trials):  # workers: only the one that created the study
        for label, params in seed_maps(result, objective.units, sweep).items():
            study.enqueue_trial({_param(u): k for u, k in params.items()}, user_attrs={"seed": label})
    remaining = int(sweep.n_trials) - n_finished(study)
    log.info("study %s: %d finished, running %d more%s", sweep.study_name, n_finished(study),
             max(remaining, 0), f" (failed stale trials {stale})" if stale else "")
    if worker:
        optimize_shared(study, objective, sweep, catch=(RuntimeError, ValueError))
        with _file_lock(out_dir / ".report.lock"):  # workers finishing together
            return write_report(study, result, sweep, out_dir)
    if remaining > 0:
        study.optimize(objective, n_trials=remaining, catch=(RuntimeError, ValueError),
                       show_progress_bar=sys.stderr.isatty())
    return write_report(study, result, sweep, out_dir)


class _file_lock:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        import fcntl

        self.f = self.path.open("a")
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        self.f.close()  # releases the lock


# --------------------------------------------------------------------------- report


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """Complete trials (with their score), then pruned ones (``pruned``: their last reported value,
    ``pruned_at_epoch``); pruned rows never enter the Pareto front."""
    rows = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        a = t.user_attrs
        rows.append({"trial": t.number, "seed": a.get("seed", ""), "conv_input_bytes": a["conv_input_bytes"],
                     "state": "complete", "pruned_at_epoch": "",
                     "score": a["score"], "mean_cosine": a["mean_cosine"],
                     "feasible": all(c <= 0 for c in a.get("constraint", [0.0])),
                     "params": json.dumps({k.removeprefix("k:"): v for k, v in t.params.items()}),
                     "config": a.get("config", ""), "map": a["map"], "rerun": a.get("rerun", "")})
    return rows


def pruned_rows(study: optuna.Study) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.PRUNED,)):
        a, steps = t.user_attrs, t.intermediate_values
        last = max(steps) if steps else None
        rows.append({"trial": t.number, "seed": a.get("seed", ""), "conv_input_bytes": a.get("conv_input_bytes", ""),
                     "state": "pruned", "pruned_at_epoch": last if last is not None else "",
                     "score": steps[last] if last is not None else "", "mean_cosine": a.get("mean_cosine", ""),
                     "feasible": all(c <= 0 for c in a.get("constraint", [0.0])),
                     "params": json.dumps({k.removeprefix("k:"): v for k, v in t.params.items()}),
                     "config": a.get("config", ""), "map": a.get("map", {}), "rerun": a.get("rerun", "")})
    return rows


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Non-dominated rows for (min conv_input_bytes, max score), sorted by bytes; one per point."""
    front, seen = [], set()
    for r in sorted(rows, key=lambda r: (r["conv_input_bytes"], -r["score"], r["trial"])):
        point = (r["conv_input_bytes"], r["score"])
        if point in seen:
            continue
        if not front or r["score"] > front[-1]["score"]:
            front.append(r)
            seen.add(point)
    return front


def write_report(study: optuna.Study, result: SensitivityResult, sweep: DictConfig, out_dir: Path) -> dict[str, Any]:
    rows = trial_rows(study)
    if not rows:
        raise RuntimeError(f"study {sweep.study_name} has no complete trial")
    front = pareto_front(rows)
    base_bytes = result.baseline_bytes()
    pruned = pruned_rows(study)
    fields = ["trial", "seed", "state", "pruned_at_epoch", "conv_input_bytes", "score", "mean_cosine",
              "feasible", "params", "config"]
    all_rows = sorted(rows + pruned, key=lambda r: r["trial"])
    for name, data in (("trials.csv", all_rows), ("pareto.csv", front)):
        with (out_dir / name).open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
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


def _markdown(front, seeds, beats, base_bytes: int, sweep: DictConfig, pruned=()) -> str:
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


def plot_pareto(rows, front, path: Path, sweep: DictConfig, pruned=()) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    mib = 2**20
    ax.scatter([r["conv_input_bytes"] / mib for r in rows], [r["score"] for r in rows], s=14,
               color="0.6", label="trials")
    ax.plot([r["conv_input_bytes"] / mib for r in front], [r["score"] for r in front], "o-",
            color="tab:red", ms=5, label="Pareto front")
    shown = [r for r in pruned if r["score"] != "" and r["conv_input_bytes"] != ""]
    if shown:
        ax.scatter([r["conv_input_bytes"] / mib for r in shown], [r["score"] for r in shown], s=18,
                   marker="x", color="tab:orange", label="pruned (last reported)")
    for r in rows:
        if r["seed"]:
            ax.scatter(r["conv_input_bytes"] / mib, r["score"], marker="*", s=120, color="tab:blue", zorder=3)
            ax.annotate(r["seed"], (r["conv_input_bytes"] / mib, r["score"]), fontsize=7,
                        xytext=(4, -10), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("conv-input bytes kept for backward (MiB, log)")
    ax.set_ylabel("mean weight-gradient cosine" if sweep.objective == "fidelity" else sweep.score_key)
    extra = f" + {len(pruned)} pruned" if pruned else ""
    ax.set_title(f"{sweep.study_name}: {len(rows)} trials{extra}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
