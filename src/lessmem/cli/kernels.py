"""``lessmem-kernels``: build the fused CPU kernels now (else the first compressed step does),
so that a container image or a cluster job starts with them ready. Run it once per kind of CPU
that shares the cache: each instruction set gets its own binary."""

from __future__ import annotations

from lessmem.core import build_cpu_kernels


def main() -> int:
    where = build_cpu_kernels()
    print("lessmem fused CPU kernels:", f"built and loaded from {where}" if where else "unavailable")
    return 0 if where else 1


if __name__ == "__main__":
    raise SystemExit(main())
