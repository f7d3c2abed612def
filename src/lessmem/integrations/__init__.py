"""lessmem where fine-tuning happens: callbacks for training frameworks, one module each, each
importing its framework (``import lessmem`` never needs one).

    from lessmem.integrations.hf import LessmemCallback         # transformers.Trainer
    trainer.add_callback(LessmemCallback(trainer, memory_budget="6GiB"))

    from lessmem.integrations.lightning import LessmemCallback  # lightning.pytorch.Trainer
    Trainer(callbacks=[LessmemCallback(preset="lossy_int8")])

Both apply one plan on the first training batch (a map, a preset ``conf/compression/<name>.yaml``
or the plan ``lessmem.fit`` chooses for a whole-step memory budget), log the saved bytes against
stock's and the step's whole peak through the trainer's own loggers, and with ``adapt_every``
re-choose within the budget from the menu measured on the current weights
(``CompressionSchedule``, framework-free)."""

from lessmem.integrations.schedule import BatchCall, CompressionSchedule

__all__ = ["BatchCall", "CompressionSchedule"]
