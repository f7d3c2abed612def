"""Optuna search workers sharing a study on a real PostgreSQL server (docs/scale_out.md).

The fixture starts its own throw-away server (initdb + pg_ctl, unix socket only, no TCP port) and
skips when the server binaries or the driver are missing: ``.ci/run`` installs PostgreSQL where
apt allows, ``pip install -e '.[postgres]'`` the driver. Three ``lessmem-search worker=true``
processes run one study; one is SIGKILLed in its first training step (``LESSMEM_FAULT``) and
started again. Its trial must go stale (no heartbeat) and be failed, its map must run again or
stay queued, and the workers together must finish exactly ``n_trials``.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
SERVER_USER = "postgres"  # the server refuses to run as root; Debian's package creates this user
DATABASE = "lessmem"
KILLED = -signal.SIGKILL


def _server_bin() -> Path | None:
    """The newest installed server's bin folder (Debian keeps one per major version)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                   key=lambda p: tuple(int(x) for x in p.parts[-3].split(".") if x.isdigit()))
    return found[-1].parent if found else None


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    """A fresh server on a unix socket in a private folder; its SQLAlchemy URL (psycopg 3)."""
    psycopg = pytest.importorskip("psycopg", reason="PostgreSQL driver missing: pip install -e '.[postgres]'")
    bin_dir = _server_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL server not installed (no /usr/lib/postgresql/*/bin/pg_ctl; "
                    "apt-get install postgresql)")
    as_root = os.geteuid() == 0
    if as_root and (SERVER_USER not in {u.pw_name for u in pwd.getpwall()} or shutil.which("runuser") is None):
        pytest.skip(f"running as root without a '{SERVER_USER}' user or runuser to run the server as")
    root = Path(tempfile.mkdtemp(prefix="lessmem-pg-"))  # short: unix socket paths max ~100 chars
    as_user: list[str] = []
    if as_root:
        user = pwd.getpwnam(SERVER_USER)
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", SERVER_USER, "--"]
    data, log = root / "data", root / "server.log"

    def pg(tool: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*as_user, str(bin_dir / tool), *args], capture_output=True, text=True,
                              timeout=120)

    init = pg("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
              "--locale=C", "--no-sync")
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"initdb failed: {init.stdout[-1000:]}{init.stderr[-2000:]}")
    # Socket only, in our folder: no port to collide with; fsync off: the data is thrown away.
    with (data / "postgresql.conf").open("a") as conf:
        conf.write(f"listen_addresses = ''\nunix_socket_directories = '{root}'\nfsync = off\n")
    start = pg("pg_ctl", "-D", str(data), "-l", str(log), "-w", "-t", "60", "start")
    try:
        if start.returncode != 0:
            pytest.fail(f"pg_ctl start failed: {start.stderr[-1000:]}\n"
                        f"{log.read_text()[-2000:] if log.exists() else ''}")
        with psycopg.connect(host=str(root), user="postgres", dbname="postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        yield f"postgresql+psycopg://postgres@/{DATABASE}?host={root}"
    finally:
        pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def _env(fault: str | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env.pop("LESSMEM_FAULT", None)
    if fault:
        env["LESSMEM_FAULT"] = fault
    return env


def _search_args(out: Path, storage: str, n_trials: int, tiny: tuple[str, ...]) -> list[str]:
    """Accuracy trials (the kill lands in training) on ``tiny``, stock underneath. Heartbeat every
    second, stale after 8 s: the killed trial is retried quickly."""
    base = [*tiny, "compression=none"]
    # The URL is quoted: its '=' would end a Hydra override's value.
    opts = {"study_name": "pg", "out_dir": str(out), "storage": f"'{storage}'", "n_trials": n_trials,
            "menu": "kernels", "budget": 0.6, "poll_s": 0.5, "heartbeat_s": 1, "grace_s": 8,
            "sensitivity.batches": 1, "sensitivity.batch_size": 8, "base_overrides": base}
    return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in opts.items()]


def _start(args: list[str], cwd: Path, fault: str | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lessmem.cli.search", "-cd", str(REPO / "sweeps"), "-cn",
                             "train_resnet20", "worker=true", *args], cwd=cwd,
                            env=_env(fault), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> int:
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode in (0, KILLED), stdout[-2000:] + stderr[-4000:]
    return proc.returncode


@pytest.mark.slow
def test_three_workers_one_killed_mid_trial_then_rerun(postgres_url: str, tmp_path: Path, tiny: tuple[str, ...]) -> None:
    import optuna

    from lessmem.search import make_storage

    out, n = tmp_path / "s", 4
    args = _search_args(out, postgres_url, n, tiny)
    # No tables yet: the three workers race to create them (make_storage retries the losers).
    workers = [_start(args, tmp_path) for _ in range(2)]
    doomed = _start(args, tmp_path, fault="train_step:1")
    assert _finish(doomed) == KILLED

    study = optuna.load_study(study_name="pg", storage=make_storage(postgres_url))
    # Its trial (retries copy the killed trial's user attrs, hence the filter): RUNNING with a
    # stopped heartbeat, or already failed by a live worker after grace_s.
    victims = [t for t in study.trials if t.user_attrs.get("worker", {}).get("pid") == doomed.pid
               and not t.user_attrs.get("surplus") and "failed_trial" not in t.system_attrs]
    assert [t.state.name for t in victims] in (["RUNNING"], ["FAIL"]), victims
    victim = victims[0]

    workers.append(_start(args, tmp_path))  # the killed worker started again
    assert [_finish(w) for w in workers] == [0, 0, 0]

    study = optuna.load_study(study_name="pg", storage=make_storage(postgres_url))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    queued = [t for t in study.trials if t.state == optuna.trial.TrialState.WAITING]
    assert len(complete) == n  # exactly n_trials together, none counted twice
    assert not [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    assert study.trials[victim.number].state == optuna.trial.TrialState.FAIL
    # Nothing lost: the killed map ran again, or is still queued when a trial sampled while its
    # retry was being queued made up the total; every seed map ran once or is queued.
    # A queued trial has no params yet: its map is the fixed_params it was enqueued with.
    maps = [t.params for t in complete] + [t.system_attrs.get("fixed_params", t.params) for t in queued]
    assert victim.params in maps
    seeds = [t.user_attrs["seed"] for t in complete if "seed" in t.user_attrs]
    assert len(seeds) == len(set(seeds))  # no seed run twice
    waiting = [t.user_attrs["seed"] for t in queued if "seed" in t.user_attrs]
    assert sorted({*seeds, *waiting}) == ["knapsack"]
    assert json.loads((out / "summary.json").read_text())["complete_trials"] == n
