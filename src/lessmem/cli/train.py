"""``lessmem-train`` (``python -m lessmem.cli.train``): one run, or a sweep with ``-m``.

SIGINT (Ctrl-C) or SIGTERM (a cluster's preemption) stops a run after its current step with a
checkpoint; one line says where it stopped and the command that continues it, and the exit
status is 130 / 143."""

from __future__ import annotations

import shlex
import sys
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lessmem.cli.errors import hydra_entry, job_errors
from lessmem.experiment import Interrupted, conf_dir, run, task_of

CONF_DIR = str(conf_dir())
PROG = "lessmem-train"


def resume_command(overrides: list[str], out_dir: str, own_dir: bool) -> str:
    """The command line that continues an interrupted run: its overrides, ``resume=true`` and its
    directory (``out_dir=`` when the user chose it, else Hydra's ``hydra.run.dir=``)."""
    where = "out_dir" if own_dir else "hydra.run.dir"
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("resume", "out_dir", "hydra.run.dir")]
    return shlex.join([PROG, *kept, "resume=true", f"{where}={out_dir}"])


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _train(cfg: DictConfig) -> dict[str, Any]:
    own_dir = bool(cfg.get("out_dir"))
    if not own_dir:
        OmegaConf.set_struct(cfg, False)
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    try:
        with job_errors(PROG):
            m = run(cfg)
    except Interrupted as stop:
        command = resume_command(list(HydraConfig.get().overrides.task), str(stop.out_dir), own_dir)
        print(f"{PROG}: {stop.name}: stopped {stop.where}, checkpoint {stop.out_dir / 'checkpoint.pt'}; "
              f"continue with: {command}", file=sys.stderr)
        raise SystemExit(stop.exit_code) from None
    except KeyboardInterrupt:  # before the first step (nothing to save yet), or a second Ctrl-C
        print(f"{PROG}: interrupted outside a training step; the last checkpoint, if any, is in {cfg.out_dir}",
              file=sys.stderr)
        raise SystemExit(130) from None
    print(
        f"{m['model']} / {m['compression']}: {task_of(cfg).headline(m)}, saved {m['saved_bytes'] / 2**20:.2f} MiB vs stock "
        f"{m['stock_saved_bytes'] / 2**20:.2f} MiB (ratio {m['ratio']:.3f}), whole-step peak ratio "
        f"{m['step_peak_ratio']:.3f}, "
        f"{m['train_time_s']:.1f}s -> {cfg.out_dir}"
        + (f" (DIVERGED at epoch {m['diverged']['epoch']}, step {m['diverged']['step']})" if m.get("diverged") else "")
    )
    return m  # the metrics, for sweepers that optimize them (hydra.sweeper.objectives)


def train_main() -> None:
    """``lessmem-train`` / ``python -m lessmem.cli.train``: one run (or a sweep with ``-m``); Hydra
    arguments. Bad settings, missing data or an unreadable checkpoint: one error line, exit 2."""
    hydra_entry(PROG, _train)


if __name__ == "__main__":
    train_main()
