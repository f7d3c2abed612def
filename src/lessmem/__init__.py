"""lessmem: train neural networks with compressed activations.

The core is ``lessmem.compress`` (torch only). The experiment framework (Hydra, Optuna, W&B) lives
in ``lessmem.train``, ``lessmem.sensitivity`` and ``lessmem.search`` and is imported on demand.
"""

from lessmem import compress  # callable module: lessmem.compress(model, mapping)
from lessmem.compress import (
    CoverageReport,
    LayerSpec,
    MemoryReport,
    compressed_layers,
    compressible_layers,
    coverage,
    measure_memory,
    uncompress,
)

__version__ = "0.1.0"
__all__ = [
    "CoverageReport",
    "LayerSpec",
    "MemoryReport",
    "compress",
    "compressed_layers",
    "compressible_layers",
    "coverage",
    "measure_memory",
    "uncompress",
]
