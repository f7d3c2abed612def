"""Where an Optuna study lives, for ``lessmem-search`` and the Hydra sweeper alike: in memory, a
journal file, or an RDB (with heartbeats when many workers share it)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from optuna.storages import (
    BaseStorage,
    JournalStorage,
    RDBStorage,
    RetryHeartbeatStaleTrialCallback,
)
from optuna.storages.journal import JournalFileBackend
from sqlalchemy.exc import IntegrityError, ProgrammingError

SCHEMA_ATTEMPTS = 5


@dataclass(frozen=True)
class Heartbeat:
    """RDB heartbeats: a trial silent for ``grace_s`` is stale and retried up to ``max_retry`` times."""

    interval_s: int = 60
    grace_s: int = 180
    max_retry: int = 2


def make_storage(storage: str | Path | None, heartbeat: Heartbeat | None = None) -> BaseStorage | None:
    """None: in memory; an RDB URL (``scheme://...``): RDBStorage, with ``heartbeat`` if given;
    anything else: a journal file (lock-protected appends, safe on a shared file system)."""
    if storage is None:
        return None
    if "://" in str(storage):
        hb = {} if heartbeat is None else {
            "heartbeat_interval": heartbeat.interval_s, "grace_period": heartbeat.grace_s,
            "heartbeat_stale_trial_callback": RetryHeartbeatStaleTrialCallback(max_retry=heartbeat.max_retry)}
        # Workers started together on an empty database race to create Optuna's tables (on
        # PostgreSQL the losers get a duplicate-key error): the tables exist after the winner, so retry.
        for attempt in range(SCHEMA_ATTEMPTS):
            try:
                return RDBStorage(str(storage), **hb)
            except (IntegrityError, ProgrammingError):
                if attempt == SCHEMA_ATTEMPTS - 1:
                    raise
                time.sleep(random.uniform(0.2, 1.0))
    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(str(storage)))
