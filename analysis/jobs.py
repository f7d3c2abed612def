"""Training jobs of the analysis drivers (proof_2x2.py, criterion_check.py, proof.py): each run
is its own process (``OMP_NUM_THREADS=threads``, niced), ``workers`` at a time; a job whose done-file
exists is skipped and an interrupted one resumes from its checkpoint.

    python analysis/jobs.py _train <run_dir> <keep 0|1> <overrides...>   # one run (what a job calls)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


@dataclass
class Job:
    name: str
    argv: list[str]
    done: Path  # the file whose existence means the job is complete
    deps: list[str] = field(default_factory=list)
    needs: list[Path] = field(default_factory=list)  # files that must exist before it starts (maps)
    proc: subprocess.Popen | None = None
    log: Path | None = None


def train_job(out: Path, name: str, seed: int, overrides: list[str], common: list[str],
              deps: list[str] | None = None, keep: bool = False, needs: list[Path] | None = None) -> Job:
    run_dir = out / "runs" / name / f"seed{seed}"
    argv = [sys.executable, str(HERE / "jobs.py"), "_train", str(run_dir), "1" if keep else "0",
            *common, *overrides, f"seed={seed}"]
    return Job(f"{name}/seed{seed}", argv, run_dir / "metrics.json", deps or [], needs or [])


def _train(run_dir: str, keep: str, overrides: list[str]) -> None:
    """One training run; ``keep``: copy the checkpoint after every epoch (for sensitivity)."""
    from lessmem.experiment import compose_config, run

    run_dir_p = Path(run_dir)
    resume = (run_dir_p / "checkpoint.pt").exists()
    cfg = compose_config([*overrides, f"out_dir={run_dir}", f"resume={str(resume).lower()}"])

    def copy_checkpoint(epoch: int, record: dict) -> None:
        if keep == "1":
            shutil.copyfile(run_dir_p / "checkpoint.pt", run_dir_p / f"checkpoint_epoch{epoch}.pt")

    run(cfg, on_epoch_end=copy_checkpoint)


def schedule(jobs: list[Job], workers: int, threads: int, out: Path,
             resolve: Callable[[list[str]], list[str]] | None = None) -> None:
    """Run ``jobs`` respecting their deps; ``resolve`` rewrites a job's argv when it starts."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "WANDB_MODE": "disabled", "TQDM_DISABLE": "1"}
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    pending = [j for j in jobs if not j.done.exists()]
    finished = {j.name for j in jobs if j.done.exists()}
    failed: set[str] = set()
    running: list[Job] = []
    print(f"{len(finished)} jobs already done, {len(pending)} to run", flush=True)
    while pending or running:
        for j in list(running):
            rc = j.proc.poll()
            if rc is None:
                continue
            running.remove(j)
            ok = rc == 0 and j.done.exists()
            (finished if ok else failed).add(j.name)
            print(f"{time.strftime('%H:%M:%S')} {'done' if ok else f'FAILED rc={rc}'}: {j.name} (log {j.log})",
                  flush=True)
        for j in list(pending):
            if len(running) >= workers:
                break
            if any(d in failed for d in j.deps):
                pending.remove(j)
                failed.add(j.name)
                print(f"skipped (dependency failed): {j.name}", flush=True)
                continue
            if not all(d in finished for d in j.deps) or not all(f.exists() for f in j.needs):
                continue
            argv = resolve(j.argv) if resolve else j.argv
            j.log = logs / (j.name.replace("/", "_") + ".log")
            j.proc = subprocess.Popen(["nice", "-n", "10", *argv], stdout=j.log.open("a"),
                                      stderr=subprocess.STDOUT, env=env, cwd=REPO)
            pending.remove(j)
            running.append(j)
            print(f"{time.strftime('%H:%M:%S')} start: {j.name}", flush=True)
        time.sleep(5)
    print(f"finished {len(finished)}, failed {sorted(failed)}", flush=True)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "_train":
    _train(sys.argv[2], sys.argv[3], sys.argv[4:])
