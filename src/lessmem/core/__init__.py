"""The core: compressed activations for any ``nn.Module`` (torch only, no Hydra).

    from lessmem.core import compress, measure_memory, uncompress
    compress(model, {"layer1.*": 4, "*": 2})   # fnmatch patterns on module names; first match wins
    report = measure_memory(model, images)
    uncompress(model)

Other layers use the core through the names exported here.
"""

from lessmem.core.compress import compress, compressed_layers, uncompress
from lessmem.core.coverage import CoverageReport, coverage
from lessmem.core.functions.pooling import expand_blocks, pool_blocks
from lessmem.core.kernels.cpu import build_cpu_kernels
from lessmem.core.mapping import compressible_layers, resolve_mapping
from lessmem.core.memory import MemoryReport, measure_memory
from lessmem.core.patterns import first_match
from lessmem.core.spec import LayerSpec, parse_spec
from lessmem.core.storage import STORAGES

__all__ = [
    "STORAGES",
    "CoverageReport",
    "LayerSpec",
    "MemoryReport",
    "build_cpu_kernels",
    "compress",
    "compressed_layers",
    "compressible_layers",
    "coverage",
    "expand_blocks",
    "first_match",
    "measure_memory",
    "parse_spec",
    "pool_blocks",
    "resolve_mapping",
    "uncompress",
]
