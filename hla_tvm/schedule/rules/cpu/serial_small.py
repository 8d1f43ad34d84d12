"""Rule for functions of static shapes whose whole work is small (at most PARALLEL_MIN loop
iterations over all blocks, e.g. a norm of one token's row when the batch is static): their
element-wise chains are inlined and everything runs serially on the calling thread.

dlight's CPU Reduction rule parallelizes such a function over the first block's loop, which for
a legalized RMSNorm of x [1, 1, 128] is the cast of its 128 weights, and computes the whole norm
inside it: 128 times over, with a parallel launch (17 us a norm, measured on the Zen 4 VM,
2026-12-06, in the demo model compiled with `max_batch=1`)."""
from __future__ import annotations

from tvm import s_tir
from tvm.s_tir import dlight as dl

from ...common import inline_elementwise, root_blocks, static_extent
from .parallel_fallback import PARALLEL_MIN


def small_work(sch):
    """The iterations of every block's loops when all are static and their sum is at most
    PARALLEL_MIN, else None (also for a function without a root block or blocks under it)."""
    blocks = root_blocks(sch)
    if not blocks:
        return None
    total = 0
    for block in blocks:
        work = 1
        for loop in sch.get_loops(block):
            ext = static_extent(sch, loop)
            if ext is None:
                return None
            work *= ext
        total += work
    return total if total <= PARALLEL_MIN else None


class SerialSmall(dl.ScheduleRule):
    """dlight rule: a small static function, serial (see the module docstring)."""

    def apply(self, func, target, _tunable):
        try:
            sch = s_tir.Schedule(func)
            if small_work(sch) is None:
                return None
            inline_elementwise(sch, root_blocks(sch))
            return sch
        except s_tir.ScheduleError:
            return None
