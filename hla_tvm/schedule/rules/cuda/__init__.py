"""Default CUDA schedule rules: `hla_kernels.HLAKernels`, a dlight `ScheduleRule` (the
interface of the CPU rules too), whose steps are the other modules here; `limits` says what fits
a GPU. `scheduled` applies it to one PrimFunc, remembered per process. The other functions of a
compiled model get TVM's GPU defaults (`dlight`)."""
from __future__ import annotations

from ...common import ScheduledOnce
from .hla_kernels import CHUNK_THREADS, THREADS, HLAKernels  # noqa: F401

_SCHEDULED = ScheduledOnce()


def scheduled(func, target=None, rule=None):
    """`func` (an HLA kernel PrimFunc) with `rule` (default `HLAKernels()`) applied, named as
    `func` is. Structurally equal kernels are scheduled once per process with the default rule
    (the schedule does not depend on the GPU's architecture)."""
    if rule is not None:
        name = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs \
            else None
        out = rule.apply(func, target, False).mod["main"]
        return out if name is None else out.with_attr("global_symbol", name)
    return _SCHEDULED.get(func, None,
                          lambda plain: HLAKernels().apply(plain, target, False).mod["main"])
