"""lessmem: train neural networks with compressed activations.

The library (torch only): ``compress``, ``uncompress``, ``measure_memory`` (saved-for-backward
bytes), ``measure_step_memory`` (whole-step peak), ``coverage``, ``measure_menu``
(every compression choice a ``MenuOptions`` offers: its bytes and gradient error; ``MenuResult.make_map`` picks a map) and
``fit`` (a plan whose whole training step fits a memory budget: ``compress(model, fit(...).plan)``)
below, and ``causal_lm_loss`` (a language model's loss that keeps only its logits for backward); every chooser hands back one ``CompressionPlan``, what ``compress`` takes. The
experiment framework (Hydra, Optuna, W&B) is built on it in ``lessmem.experiment``, ``lessmem.search``, ``lessmem.reporting`` and ``lessmem.cli``; see
docs/architecture.md for the layers and the one direction their imports run.
"""

from lessmem.core import (
    CompressionPlan,
    CoverageReport,
    LayerSpec,
    MemoryReport,
    StepMemoryReport,
    causal_lm_loss,
    chunked_cross_entropy,
    compress,
    compressed_layers,
    compressible_layers,
    coverage,
    measure_memory,
    measure_step_memory,
    track_step_memory,
    uncompress,
)
from lessmem.sensitivity import BudgetFit, MenuOptions, MenuResult, ScoredPlan, fit, measure_menu

__version__ = "0.1.0"
__all__ = [
    "BudgetFit",
    "CompressionPlan",
    "CoverageReport",
    "LayerSpec",
    "MemoryReport",
    "MenuOptions",
    "MenuResult",
    "ScoredPlan",
    "StepMemoryReport",
    "causal_lm_loss",
    "chunked_cross_entropy",
    "compress",
    "compressed_layers",
    "compressible_layers",
    "coverage",
    "fit",
    "measure_memory",
    "measure_menu",
    "measure_step_memory",
    "track_step_memory",
    "uncompress",
]
