"""Where a study lives: an Optuna journal file, or an RDB with heartbeats for many workers."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend
from sqlalchemy.exc import IntegrityError, ProgrammingError

SCHEMA_ATTEMPTS = 5


def make_storage(sweep: DictConfig, storage: str | Path) -> Any:
    """An RDB URL (``scheme://...``): RDBStorage with heartbeats, killed trials retried; anything
    else: a journal file (lock-protected appends, safe on a shared file system)."""
    if "://" in str(storage):
        retry = RetryHeartbeatStaleTrialCallback(max_retry=int(sweep.max_retry))
        # Workers started together on an empty database race to create Optuna's tables (on
        # PostgreSQL the losers get a duplicate-key error): the tables exist after the winner, so retry.
        for attempt in range(SCHEMA_ATTEMPTS):
            try:
                return RDBStorage(str(storage), heartbeat_interval=int(sweep.heartbeat_s),
                                  grace_period=int(sweep.grace_s), heartbeat_stale_trial_callback=retry)
            except (IntegrityError, ProgrammingError):
                if attempt == SCHEMA_ATTEMPTS - 1:
                    raise
                time.sleep(random.uniform(0.2, 1.0))
    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(storage)))
