"""Default CUDA schedule rules: `hla_kernels.HLAKernels`, a dlight `ScheduleRule` (the
interface of the CPU rules too), whose steps are `schedule.steps.cuda`; `schedule.gpu_limits`
says what fits a GPU. `scheduled` applies it to one PrimFunc, remembered per process. The other functions of a
compiled model get TVM's GPU defaults (`dlight`)."""
from __future__ import annotations

from ...common import ScheduledOnce, named_as
from .hla_kernels import CHUNK_THREADS, THREADS, HLAKernels  # noqa: F401

_SCHEDULED = ScheduledOnce()


def scheduled(func, target=None, rule=None):
    """`func` (an HLA kernel PrimFunc) with `rule` (default `HLAKernels()`) applied, named as
    `func` is. Structurally equal kernels are scheduled once per process with the default rule
    (the schedule does not depend on the GPU's architecture)."""
    if rule is not None:
        return named_as(func, lambda plain: rule.apply(plain, target, False).mod["main"])
    return _SCHEDULED.get(func, None,
                          lambda plain: HLAKernels().apply(plain, target, False).mod["main"])
