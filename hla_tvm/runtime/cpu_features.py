"""x86-64 CPU features: the instruction-set extensions this CPU reports, in LLVM's names, and the
check a module's loader makes before any of its code can run.

LLVM picks a CPU's features from its model name, and a VM may report a model whose LLVM
namesake lacks what the CPU has (an Intel Xeon with AMX and AVX512-BF16 seen as `rocketlake`,
which has neither) or has what the VM masks. So the host target is built from the features
the CPU reports (`hla_tvm.target.host_target`), a module records the features its code may
use (its metadata's "cpu_features"), and `missing` names those this CPU lacks, which loading
refuses (running them would be SIGILL)."""
from __future__ import annotations

import functools
import platform

# /proc/cpuinfo flag -> LLVM feature, for the extensions compiled kernels may use
X86 = {
    "sse4_2": "sse4.2", "avx": "avx", "f16c": "f16c", "fma": "fma", "avx2": "avx2",
    "bmi2": "bmi2", "avx512f": "avx512f", "avx512cd": "avx512cd", "avx512bw": "avx512bw",
    "avx512dq": "avx512dq", "avx512vl": "avx512vl", "avx512vbmi": "avx512vbmi",
    "avx512_vbmi2": "avx512vbmi2", "avx512_vnni": "avx512vnni", "avx_vnni": "avxvnni",
    "avx512_bf16": "avx512bf16", "avx512_fp16": "avx512fp16", "amx_tile": "amx-tile",
    "amx_bf16": "amx-bf16", "amx_int8": "amx-int8",
}
# features whose code is compiled only where the CPU has them (never from a model name alone)
AMX = ("amx-tile", "amx-bf16", "amx-int8")


def is_x86_host():
    """Whether this machine is x86-64."""
    return platform.machine() in ("x86_64", "AMD64")


@functools.lru_cache(maxsize=None)
def host_features():
    """The LLVM names of the X86 features this CPU reports (/proc/cpuinfo's flags), or None
    where they cannot be read (not Linux, not x86-64)."""
    if not is_x86_host():
        return None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split())
                    return frozenset(llvm for flag, llvm in X86.items() if flag in flags)
    except OSError:
        return None
    return None


def missing(needed):
    """The features of `needed` (LLVM names) this CPU lacks, in order; [] where this CPU's
    features cannot be read (nothing to compare: the loader then trusts the module)."""
    have = host_features()
    if have is None:
        return []
    return [f for f in needed if f in X86.values() and f not in have]


def check(path, meta):
    """ValueError naming the first feature the module at `path` (metadata `meta`) needs that
    this CPU lacks; nothing for a module without the record (one compiled for another
    architecture has none)."""
    needed = meta.get("cpu_features")
    if not needed or not is_x86_host():
        return
    lacking = missing(needed)
    if lacking:
        raise ValueError(
            f"{path} was compiled for a CPU with {', '.join(lacking)}, which this CPU lacks "
            "(its code would stop with an illegal instruction): compile it on this machine "
            "(--target llvm) or for every x86-64 CPU (--target x86-64)")
