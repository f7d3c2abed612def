"""A Hydra sweeper on Optuna 5 (``hydra/sweeper=lessmem_optuna``), shipped with lessmem because
hydra-optuna-sweeper pins optuna<3. Generic: it knows nothing of lessmem beyond the default
objective key. Hydra finds it by scanning the ``hydra_plugins`` namespace package."""
