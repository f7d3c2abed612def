"""lessmem in Lightning:

    Trainer(callbacks=[LessmemCallback(memory_budget="6GiB")])

On the first training batch the callback compresses the LightningModule in place
(``CompressionSchedule``: a map, a preset or the plan ``lessmem.fit`` chooses for the budget, with
the trainer's first optimizer and the module's own ``training_step`` loss under the trainer's
precision), and at the batch's end logs the figures to every one of the trainer's loggers (W&B
when a ``WandbLogger`` is among them). Measurements run ``training_step`` on copies of the module,
which have no trainer: their ``self.log`` calls go nowhere. Automatic optimization only (a manual
``training_step`` steps its own optimizers)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn

from lessmem.core import CompressionPlan
from lessmem.integrations.schedule import BatchCall, CompressionSchedule, LossOf

# What Lightning warns when a module without a trainer logs (a measured copy does).
_NO_TRAINER_LOG = r"You are trying to `self\.log\(\)`"


def step_loss(context: Callable[[], AbstractContextManager[Any]]) -> LossOf:
    """The loss ``training_step(batch, 0)`` returns (a tensor, or a dict's ``"loss"``), computed under
    ``context`` (the trainer's precision)."""
    def loss_of(module: nn.Module, batch: Any) -> Tensor:
        with context(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_TRAINER_LOG)
            out = module.training_step(batch, 0)
        return out["loss"] if isinstance(out, Mapping) else out
    return loss_of


class LessmemCallback(pl.Callback):
    """Compresses the LightningModule on its first training batch and, with ``adapt_every``, again
    every that many optimizer steps; ``plan`` and ``options`` are ``CompressionSchedule``'s (one of a
    plan or map, ``preset=`` or ``memory_budget=``). ``schedule.plan`` is the plan in force."""

    def __init__(self, plan: CompressionPlan | Mapping[str, Any] | None = None, **options: Any) -> None:
        self.schedule = CompressionSchedule(plan, **options)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self.schedule.due(trainer.global_step):
            return
        if not pl_module.automatic_optimization:
            raise ValueError("lessmem: LessmemCallback measures steps of automatic optimization; this module "
                             "optimizes manually (automatic_optimization = False)")
        call = BatchCall(pl_module, batch, step_loss(trainer.precision_plugin.train_step_context))
        self.schedule.apply(pl_module, call, trainer.global_step, copies=True,
                            optimizer=next(iter(trainer.optimizers), None))

    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning's checkpoints: resumed (``ckpt_path=``), a budget's map goes on unfitted."""
        return self.schedule.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.schedule.load_state_dict(state_dict)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        figures = self.schedule.finish()
        if figures:
            for logger in trainer.loggers:
                logger.log_metrics(figures, step=trainer.global_step)
