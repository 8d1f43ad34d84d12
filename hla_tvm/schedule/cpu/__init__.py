"""Default CPU schedule rules, one per module; `apply` runs them in order on every function."""
from .parallel_outer import parallel_outer
from .vectorize_inner import vectorize_inner

from ...kernels._tir import PRESCHEDULED

RULES = (parallel_outer, vectorize_inner)


def apply(sch, func_name):
    """Apply every default CPU rule to `func_name` in the schedule `sch` (in place)."""
    sch.work_on(func_name)
    if sch.mod[func_name].attrs.get(PRESCHEDULED, False):
        return sch
    for rule in RULES:
        rule(sch, func_name)
    return sch
