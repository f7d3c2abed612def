"""lessmem in the HF transformers ``Trainer`` (PEFT models included):

    trainer.add_callback(LessmemCallback(trainer, memory_budget="6GiB"))

The callback sees the first training batch as the model's forward receives it (a forward pre-hook:
the Trainer hands batches to no callback), compresses the model in place before that forward runs
(``CompressionSchedule``: a map, a preset or the plan ``lessmem.fit`` chooses for the budget, with
the trainer's optimizer and the model's own loss, so the batches need labels), and at the step's
end logs the figures through ``trainer.log``: the trainer's log history and every ``report_to``
integration (W&B when it is on). It holds the trainer for that: the events it gets carry no handle
to log through. Each Trainer checkpoint gets the plan in force (``lessmem_schedule.json``): resumed
from it, a budget's map goes on without fitting again.

``use_chunked_loss(model)`` makes the model's own loss one that keeps only the logits for backward
(``lessmem.causal_lm_loss``): at long contexts the loss, not the layers, holds most bytes."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from transformers import (
    PreTrainedModel,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from lessmem.core import CompressionPlan, causal_lm_loss, saved_storage
from lessmem.integrations.schedule import BatchCall, CompressionSchedule

if TYPE_CHECKING:
    from transformers import Trainer

log = logging.getLogger(__name__)
SCHEDULE_FILE = "lessmem_schedule.json"  # in each Trainer checkpoint: the plan in force, for a resumed run


def model_loss(model: nn.Module, batch: tuple[tuple[Any, ...], dict[str, Any]]) -> Tensor:
    """The loss an HF model returns for ``batch`` (its forward's positional and keyword arguments)."""
    args, kwargs = batch
    out = model(*args, **kwargs)
    loss = out.get("loss") if isinstance(out, Mapping) else None
    if not isinstance(loss, Tensor):
        raise ValueError("lessmem: the model returned no loss for its training batch; LessmemCallback measures the "
                         "model's own loss, so the batches need labels")
    return loss


class LessmemCallback(TrainerCallback):
    """Compresses the Trainer's model on its first training batch and, with ``adapt_every``, again
    every that many optimizer steps; ``plan`` and ``options`` are ``CompressionSchedule``'s (one of a
    plan or map, ``preset=`` or ``memory_budget=``). ``schedule.plan`` is the plan in force."""

    def __init__(self, trainer: Trainer, plan: CompressionPlan | Mapping[str, Any] | None = None, **options: Any) -> None:
        self.trainer = trainer
        self.schedule = CompressionSchedule(plan, **options)
        self._hook: RemovableHandle | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module, **kwargs: Any) -> None:
        self._hook = model.register_forward_pre_hook(_watching(self, model), with_kwargs=True)
        if state.global_step:  # resumed: go on with the plan in force at the checkpoint, unfitted
            saved = _checkpoint_dir(args, state) / SCHEDULE_FILE
            if saved.is_file():
                self.schedule.load_state_dict(json.loads(saved.read_text()))
            elif self.schedule.budget is not None:
                log.warning("lessmem: no %s in %s: the budget's plan is fitted again and may differ from the one "
                            "trained so far", SCHEDULE_FILE, saved.parent)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        folder = _checkpoint_dir(args, state)
        if args.should_save and folder.is_dir():
            (folder / SCHEDULE_FILE).write_text(json.dumps(self.schedule.state_dict()))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        figures = self.schedule.finish()
        if figures:
            should_log = control.should_log
            self.trainer.log(figures)
            control.should_log = should_log  # trainer.log clears it: the step's own loss is still to log

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def before_forward(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward of the model is about to run on a batch: apply a plan if one is due."""
        if not (model.training and torch.is_grad_enabled()) or not self.schedule.due(self.trainer.state.global_step):
            return
        optimizer = self.trainer.optimizer
        had_hooks = saved_storage.attached(model)
        self.schedule.apply(model, BatchCall(model, (args, kwargs), model_loss), self.trainer.state.global_step,
                            optimizer=getattr(optimizer, "optimizer", optimizer))  # accelerate wraps the optimizer
        if saved_storage.attached(model) and not had_hooks:
            # torch took this call's pre-hooks before the plan added the model's own: enter it for this call
            saved_storage.enter_forward(model, args, kwargs)


def _checkpoint_dir(args: TrainingArguments, state: TrainerState) -> Path:
    """The Trainer's checkpoint folder of ``state``'s step (``resume_from_checkpoint=True`` takes the last)."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


def _watching(callback: LessmemCallback, model: nn.Module) -> Callable[[nn.Module, tuple, dict], None]:
    """The pre-hook: a plain function (a copy of the model, as ``lessmem.fit`` makes, copies the
    function, not the callback and its trainer) that acts on ``model`` alone, not on its copies."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module is model:
            callback.before_forward(module, args, kwargs)
    return hook


def use_chunked_loss(model: nn.Module) -> nn.Module:
    """Make an HF causal LM's own loss (``model(input_ids, labels=...)``, the Trainer's) lessmem's
    ``causal_lm_loss``: the same next-token cross-entropy to float rounding, keeping the logits
    alone for backward instead of float32 log-probabilities of every token. ``model`` may be
    wrapped (a PEFT model): the loss goes to every submodule with HF's ``loss_function``."""
    owners = [m for m in model.modules() if isinstance(m, PreTrainedModel) and hasattr(type(m), "loss_function")]
    if not owners:
        raise ValueError(f"lessmem: {type(model).__name__} holds no HF transformers model with a loss_function")
    for owner in owners:
        owner.loss_function = causal_lm_loss
    return model
