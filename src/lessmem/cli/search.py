"""``lessmem-search -cd sweeps -cn <search> [key=value ...]``: an Optuna search over compression
maps (``lessmem.search``), resumed by rerunning the same command. The config is a search config
(``defaults: [search, _self_]``, e.g. ``sweeps/menu_resnet20.yaml``); there is no default search.
Everything goes to Hydra's run dir (default ``out_dir``: ``outputs/search/<study_name>``)."""

from __future__ import annotations

import json
import logging

import hydra
import optuna
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lessmem.cli.errors import exit_on_user_error, hydra_entry
from lessmem.experiment import conf_dir
from lessmem.search import run_search

PROG = "lessmem-search"


@hydra.main(config_path=str(conf_dir()), config_name=None, version_base="1.3")
def _search(cfg: DictConfig) -> None:
    with exit_on_user_error(PROG):  # before Hydra adds its "Error executing job" line
        if "study_name" not in cfg:
            raise ValueError("no search config; name one: lessmem-search -cd sweeps -cn <name> "
                             "(a config with `defaults: [search, _self_]`)")
        cfg.out_dir = HydraConfig.get().runtime.output_dir  # out_dir= only names the run dir's default
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        logging.getLogger("lessmem").setLevel(logging.INFO)
        summary = run_search(cfg)
    print(json.dumps(summary, indent=1))
    print(f"report: {summary['report']}")


def main() -> None:
    """``lessmem-search``: bad settings or a missing config end with one error line, exit 2."""
    hydra_entry(PROG, _search)


if __name__ == "__main__":
    main()
