"""Build and load the fused C++ CPU kernels (``csrc/``): one binary per instruction set.

The build is keyed by the CPU's instruction set, the sources, the compiler flags, torch and
Python: ``$TORCH_EXTENSIONS_DIR/lessmem_cpu_<isa>_<hash>`` (default root
``~/.cache/torch_extensions``). Nodes that share a home directory but not a CPU each build and
load their own binary, so none loads code for instructions its CPU lacks (SIGILL). The AVX2
build says so explicitly (``-mavx2 -mfma``), never ``-march=native``: the binary must run on
every CPU that reports AVX2, not only on the one that built it. ``LESSMEM_CPU_ISA=scalar``
forces the portable build (``avx2`` is accepted only where the CPU has it).

Several processes may build at once (one job starting many workers): torch's ``load`` holds an
OS-level lock on ``<build dir>/lock`` while it builds, so one process compiles and the others
wait for it, then load (a killed builder releases the lock; the next process rebuilds).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

SOURCE_DIR = Path(__file__).with_name("csrc")
SOURCES = ("masks.cpp", "pooling.cpp", "maxpool.cpp", "depthwise.cpp", "quantize.cpp", "norm_codes.cpp",
           "bindings.cpp")
HEADERS = ("lessmem_cpu.h", "groups.h")
# -ffp-contract=off: a * b + c stays two roundings (no FMA), as in the torch reference's separate
# ops, so the kernels' float results are bit-identical to it
ISA_FLAGS = {
    "avx2": ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"),
    "scalar": ("-O3", "-ffp-contract=off", "-fopenmp"),
}
LINK_FLAGS = ("-fopenmp",)
ISA_ENV = "LESSMEM_CPU_ISA"


def cpu_isa() -> str:
    """The instruction set to build for: ``avx2`` where ATen runs AVX2 (or AVX-512) kernels on
    x86, else ``scalar``; ``LESSMEM_CPU_ISA`` may force ``scalar``."""
    detected = "scalar"
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if x86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        detected = "avx2"
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return detected
    if forced not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={forced!r}: choose one of {', '.join(ISA_FLAGS)}")
    if forced == "avx2" and detected != "avx2":
        raise ValueError(f"{ISA_ENV}=avx2, but this CPU does not run AVX2 code")
    return forced


def extension_name(isa: str) -> str:
    """``lessmem_cpu_<isa>_<hash>``, the hash over what makes a binary differ: the sources, the
    flags, torch and the Python ABI."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    for part in (*ISA_FLAGS[isa], *LINK_FLAGS, torch.__version__, sys.implementation.cache_tag):
        digest.update(part.encode() + b"\0")
    return f"lessmem_cpu_{isa}_{digest.hexdigest()[:12]}"


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _cpp_extension() -> ModuleType:
    """``torch.utils.cpp_extension``, imported without the "No CUDA runtime is found" warning
    it logs on CPU-only machines with a CUDA build of torch: these kernels need no CUDA."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    no_cuda = _DropMessage("No CUDA runtime is found")
    logger.addFilter(no_cuda)
    try:
        import torch.utils.cpp_extension as extension
    finally:
        logger.removeFilter(no_cuda)
    return extension


def load_kernels() -> ModuleType:
    """The kernels for this CPU, compiled first if no process has built them yet (one line on
    stderr says so: it takes about a minute)."""
    extension = _cpp_extension()
    isa = cpu_isa()
    name = extension_name(isa)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or extension.get_default_build_root()
    directory = Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / f"{name}.so").exists():
        print(f"lessmem: building fused CPU kernels ({isa}) once into {directory}, ~1 min; "
              "lessmem-kernels prebuilds them", file=sys.stderr, flush=True)
    return extension.load(  # fresh lists: load appends its own flags to them
        name=name, sources=_sources_in(directory), extra_cflags=list(ISA_FLAGS[isa]),
        extra_ldflags=list(LINK_FLAGS), build_directory=str(directory), verbose=False,
    )


def _sources_in(directory: Path) -> list[str]:
    """The sources, copied into the build directory: every install of the same sources (a
    checkout, a wheel in a venv) then builds from the same paths, where other paths would make
    ninja rebuild the shared binary. A file is written only when its content differs (a fresh
    mtime would rebuild it too), and atomically (another process may be about to compile it)."""
    for name in (*SOURCES, *HEADERS):
        text, target = (SOURCE_DIR / name).read_bytes(), directory / name
        if not target.is_file() or target.read_bytes() != text:
            partial = directory / f".{name}.{os.getpid()}"
            partial.write_bytes(text)
            os.replace(partial, target)
    return [str(directory / name) for name in SOURCES]
