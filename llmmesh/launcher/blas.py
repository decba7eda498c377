"""The BLAS kernels the reference engine runs on.

numpy<2 (which nvidia-pytriton requires) bundles OpenBLAS 0.3.23. That release does not
know AVX-512 CPUs newer than itself (AMD Zen 4 and 5 among them) and falls back to its
Haswell (AVX2) kernels, which run this model's matrix products 1.5 to 7 times slower
than its AVX-512 (SkylakeX) kernels on such a CPU (docs/benchmarks.md). OpenBLAS reads
its core type once, when it is loaded, so it is named in the environment of the
processes that load it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

CORETYPE = "OPENBLAS_CORETYPE"
# What OpenBLAS's SkylakeX kernels use.
AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags; empty where /proc/cpuinfo says none."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def openblas_environment(env: Mapping[str, str], flags: frozenset[str]) -> dict[str, str]:
    """``env`` with the AVX-512 kernels named where the CPU has them; a core type the
    user set is kept, and other CPUs are left to OpenBLAS's own detection."""
    out = dict(env)
    if CORETYPE not in out and flags >= AVX512:
        out[CORETYPE] = "SkylakeX"
    return out
