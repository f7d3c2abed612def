"""lessmem.search: resumable Optuna search over menu maps (tiny, synthetic data).

Last: Optuna search workers sharing a study on a real PostgreSQL server (docs/scale_out.md).

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

import optuna
import pytest
import torch
import yaml
from PIL import Image

from lessmem.experiment import compose_config, model_spec
from lessmem.experiment.data import fixed_batches
from lessmem.search import check_criterion, run_search
from lessmem.search.run import check_search, open_search_study
from lessmem.sensitivity import MenuOptions, measure_menu


@pytest.fixture
def base(tiny: tuple[str, ...]) -> list[str]:
    """The stock tiny run each trial's map goes on top of."""
    return [*tiny, "compression=none"]


def search_cfg(tmp_path, base: list[str], *over: str):
    """A search config composed as lessmem-search composes it (conf/search.yaml)."""
    return compose_config(["study_name=t", f"out_dir={tmp_path / 's'}", "n_trials=3", "budget=0.4",
                           "criterion=grad_error", f"base_overrides={json.dumps(base)}", *over], "search")


def menu_file(tmp_path, base: list[str]):
    cfg = compose_config(base)
    torch.manual_seed(0)
    options = MenuOptions(kernels=(1, 2, 4), storages=("native", "int8", "int4"), norm_storages=("int8", "int4"),
                          act_storages=())
    menu = measure_menu(model_spec(cfg.model).build().train(), fixed_batches(cfg.dataset, 1, 4), options)
    menu.save(tmp_path / "menu", heatmap=False)
    return menu, tmp_path / "menu" / "menu.json"


def test_menu_search_trains_knapsack_variations_within_budget(tmp_path, monkeypatch, base) -> None:
    """Trial 0 is the criterion's own map, every trial's map fits the budget (its bytes predicted
    exactly: equal to the run's measured saved bytes), a map met again is not retrained, the best
    map is a file a run can use, and a rerun with a trial left RUNNING resumes the same study."""
    from lessmem.search.objective import Objective, weight_param

    menu, path = menu_file(tmp_path, base)
    s = search_cfg(tmp_path, base, f"menu_file={path}")
    # A second seed scaling every unit alike: the same knapsack answer, so trained once only.
    seeds = Objective.seeds
    monkeypatch.setattr(Objective, "seeds", lambda self: {
        **seeds(self), "scaled": {weight_param(u): 0.5 for u in self.units}})
    summary = run_search(s)
    assert summary["complete_trials"] == 3 and summary["knapsack"]["trial"] == 0
    study, created = open_search_study(s)
    assert not created
    trials = sorted(study.trials, key=lambda t: t.number)
    chosen = menu.make_map(0.4, "grad_error")
    knapsack = yaml.safe_load((tmp_path / "s" / "trials" / "0000" / "compression.yaml").read_text())
    assert {k: str(v) for k, v in knapsack["map"].items()} == chosen.plan.map
    assert trials[1].user_attrs["same_as"] == 0 and trials[1].value == trials[0].value
    assert not (tmp_path / "s" / "trials" / "0001" / "train").exists()
    for t in trials:
        assert t.user_attrs["ratio"] <= 0.4
    for t in (trials[0], trials[2]):
        measured = t.user_attrs["measured_saved_bytes"] / t.user_attrs["stock_saved_bytes"]
        assert measured == pytest.approx(t.user_attrs["ratio"])
    out = tmp_path / "s"
    for name in ("trials.csv", "report.md", "summary.json", "best_map.yaml"):
        assert (out / name).is_file(), name
    with Image.open(out / "search.png") as im:
        im.verify()
    best = compose_config([*base, f"compression.map_file={out / 'best_map.yaml'}"])
    assert best.compression.map_file
    # Resume: a trial left RUNNING (a killed process) fails, its params run again; done trials stay.
    study.ask({weight_param(u): optuna.distributions.FloatDistribution(-2, 2) for u in menu.unit_items()})
    summary = run_search(search_cfg(tmp_path, base, f"menu_file={path}", "n_trials=4"))
    study, _ = open_search_study(s)
    states = [t.state for t in study.trials]
    assert summary["complete_trials"] == 4 and states.count(optuna.trial.TrialState.FAIL) == 1


def test_search_config_errors(tmp_path, base) -> None:
    with pytest.raises(ValueError, match="unknown criterion 'top1'"):
        check_criterion("top1")
    with pytest.raises(ValueError, match=r"budget is a fraction of stock saved bytes in \(0, 1\]"):
        check_search(search_cfg(tmp_path, base, "budget=2"))
    with pytest.raises(FileNotFoundError, match="menu_file .* does not exist"):
        check_search(search_cfg(tmp_path, base, f"menu_file={tmp_path / 'none.json'}"))
    with pytest.raises(ValueError, match="pruner.name must be one of"):
        check_search(search_cfg(tmp_path, base, "pruner.name=asha"))


def test_search_without_a_config_is_a_usage_error(monkeypatch, capsys) -> None:
    from lessmem.cli import search

    monkeypatch.setattr(sys, "argv", ["lessmem-search"])
    with pytest.raises(SystemExit) as exit_:
        search.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lessmem-search: error: no search config")


def test_search_command_runs_a_sweeps_config(tmp_path, run_cli, base) -> None:
    """``lessmem-search -cd sweeps -cn menu_resnet20`` as documented, on tiny data: the sweep's own
    menu file, criterion, score and pruner; everything lands in its run dir. A budget below the menu's
    smallest map is one error line before any trial."""
    from pathlib import Path

    from lessmem.cli import search

    repo = Path(__file__).parents[1]
    cmd = ["-cd", str(repo / "sweeps"), "-cn", "menu_resnet20", "n_trials=1",
           f"menu_file={repo / 'docs/results/criterion_check/menu/menu.json'}", f"base_overrides={json.dumps(base)}"]
    result = run_cli(search.main, "lessmem-search", *cmd, f"hydra.run.dir={tmp_path / 's'}")  # out_dir= below
    assert result.status == 0, result.stderr
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert (tmp_path / "s" / "study.journal").is_file() and (tmp_path / "s" / "search.log").is_file()
    assert summary["complete_trials"] == 1 and summary["knapsack"]["trial"] == 0
    assert (summary["criterion"], summary["score_key"], summary["pruner"]) == ("grad_error", "final_top1", "median")
    assert summary["knapsack"]["ratio"] <= summary["budget"] == 0.547
    result = run_cli(search.main, "lessmem-search", *cmd, "budget=0.01", f"out_dir={tmp_path / 'small'}")
    assert result.is_one_error("lessmem-search", "no map fits 0.010x stock saved bytes"), result
    assert not (tmp_path / "small" / "study.journal").exists()


# ---- workers sharing a study on a real PostgreSQL server ----

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
