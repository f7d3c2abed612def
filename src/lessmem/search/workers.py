"""Trials left RUNNING by dead processes, and many workers sharing one fixed trial count.

RDB storages heartbeat every trial; a trial of a killed worker goes stale after ``grace_s`` and
is retried (``RetryHeartbeatStaleTrialCallback``). Journal storages have no heartbeat: a worker
fails only RUNNING trials whose process is gone on its own host, never one that another live
worker runs.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import optuna
from optuna.storages._heartbeat import BaseHeartbeat, is_heartbeat_enabled

from lessmem.search.study import n_finished, requeue


def fail_dead_trials(study: optuna.Study, grace_s: float) -> list[int]:
    """Worker-safe stale handling. Heartbeat storages (RDB): Optuna fails trials whose heartbeat
    stopped and the retry callback queues them again. Journal: fail (and queue again) only
    RUNNING trials whose recorded worker process no longer exists on this host, or with no
    worker recorded ``grace_s`` after their start; trials of live workers and of other hosts are
    left alone (recover those with a worker on their host, or an RDB storage)."""
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
        requeue(study, t)
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
            fixed = trial.study._storage.get_trial(trial._trial_id).system_attrs.get("fixed_params") or trial.params
            if fixed:  # a queued map (seed or retry): give it back to the queue
                trial.study.enqueue_trial(fixed, user_attrs={k: v for k, v in trial.user_attrs.items() if k == "seed"})
            trial.set_user_attr("surplus", True)
            raise _Surplus(f"study already has {len(others)} finished or running trials")
        return self.objective(trial)


def optimize_shared(study: optuna.Study, objective: Any, search: Any, catch: tuple) -> None:
    """Run trials until the study holds ``search.n_trials`` finished ones, whoever runs them."""
    n, poll = int(search.n_trials), float(search.poll_s)
    budget = SharedBudget(objective, n)
    stop = optuna.study.MaxTrialsCallback(n, states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED))
    while True:
        fail_dead_trials(study, float(search.grace_s))
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


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``path`` for a ``with`` block (workers finishing together)."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield  # closing the file releases the lock
