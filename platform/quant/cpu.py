"""What the host CPU can do, read once from /proc/cpuinfo (Linux) at run time.

Machines differ between runs (AVX2-only AMD EPYC, AVX-512 EPYC, Xeon with AMX); nothing here
assumes a feature, and torch's own kernels dispatch on the same flags internally.
"""

from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU listed, empty where /proc/cpuinfo is unreadable."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def has_fast_quant_kernels(flags: frozenset[str] | None = None) -> bool:
    """True where torch's packed low-bit and fbgemm fp16 kernels have a vectorized path (AVX2+FMA)."""
    flags = cpu_flags() if flags is None else flags
    return {"avx2", "fma"} <= flags


def isa_summary(flags: frozenset[str] | None = None) -> str:
    """The instruction sets that matter for the kernels, e.g. 'avx2 avx512f avx512_bf16 amx_tile'."""
    flags = cpu_flags() if flags is None else flags
    keep = (
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
        "avx512_bf16",
        "avx_vnni",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    )
    return " ".join(f for f in keep if f in flags) or "none of avx2/avx512/amx"
