"""The core: compressed activations for any ``nn.Module`` (torch only, no Hydra).

    from lessmem.core import compress, measure_memory, uncompress
    compress(model, {"layer1.*": 4, "*": 2})   # fnmatch patterns on module names; first match wins
    report = measure_memory(model, images)            # saved-for-backward bytes
    step = measure_step_memory(model, (images, labels), optimizer=opt)   # whole-step peak
    uncompress(model)

Other layers use the core through the names exported here.
"""

from lessmem.core.compress import (
    compress,
    compressed_layers,
    rebuildable_convs,
    storable_layers,
    uncompress,
)
from lessmem.core.coverage import CoverageReport, coverage
from lessmem.core.kernels.cpu import build_cpu_kernels
from lessmem.core.mapping import compressible_layers, first_match, resolve_mapping
from lessmem.core.memory import MemoryReport, measure_memory
from lessmem.core.ops.cross_entropy import causal_lm_loss, chunked_cross_entropy
from lessmem.core.ops.dispatch import kept_by_graph
from lessmem.core.ops.pooling import expand_blocks, expand_tokens, pool_blocks, pool_tokens
from lessmem.core.ops.recomputed_region import recomputed_modules
from lessmem.core.ops.registry import pools_tokens
from lessmem.core.plan import STORAGE_SETTINGS, CompressionPlan, StorageRule
from lessmem.core.rounding import load_rounding_state, rounding_state, set_rounding_seed
from lessmem.core.spec import FROM_NORM, LayerSpec, parse_spec
from lessmem.core.step_memory import (
    FIXED_MMAP_ENV,
    StepMemoryReport,
    alternating_step_times,
    measure_step_memory,
    peak_rss_growth,
    track_step_memory,
    training_step,
)
from lessmem.core.storage import (
    STORAGES,
    UNBIASED_STORAGES,
    TensorMeta,
    describe_storage,
    pack_tensor,
    stored_bytes,
    tensor_meta,
    unpack_tensor,
)

__all__ = [
    "FROM_NORM",
    "FIXED_MMAP_ENV",
    "STORAGES",
    "STORAGE_SETTINGS",
    "StorageRule",
    "UNBIASED_STORAGES",
    "TensorMeta",
    "CompressionPlan",
    "CoverageReport",
    "LayerSpec",
    "MemoryReport",
    "StepMemoryReport",
    "alternating_step_times",
    "build_cpu_kernels",
    "causal_lm_loss",
    "chunked_cross_entropy",
    "compress",
    "compressed_layers",
    "compressible_layers",
    "coverage",
    "describe_storage",
    "expand_blocks",
    "expand_tokens",
    "kept_by_graph",
    "first_match",
    "load_rounding_state",
    "measure_memory",
    "measure_step_memory",
    "pack_tensor",
    "parse_spec",
    "peak_rss_growth",
    "pool_blocks",
    "pool_tokens",
    "pools_tokens",
    "resolve_mapping",
    "rounding_state",
    "set_rounding_seed",
    "rebuildable_convs",
    "recomputed_modules",
    "storable_layers",
    "stored_bytes",
    "tensor_meta",
    "track_step_memory",
    "training_step",
    "uncompress",
    "unpack_tensor",
]
