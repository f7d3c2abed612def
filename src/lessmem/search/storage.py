"""Where a study lives: an Optuna journal file, or an RDB with heartbeats for many workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend


def make_storage(sweep: DictConfig, storage: str | Path) -> Any:
    """An RDB URL (``scheme://...``): RDBStorage with heartbeats, killed trials retried; anything
    else: a journal file (lock-protected appends, safe on a shared file system)."""
    if "://" in str(storage):
        retry = RetryHeartbeatStaleTrialCallback(max_retry=int(sweep.max_retry))
        return RDBStorage(str(storage), heartbeat_interval=int(sweep.heartbeat_s),
                          grace_period=int(sweep.grace_s), heartbeat_stale_trial_callback=retry)
    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(storage)))
