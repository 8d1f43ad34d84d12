"""Rule: one thread block per iteration of the independent outer loops.

The outer (batch, head[, chunk]) loops whose iterations write elements of their own
(`common.independent_outer_loops`) are fused and bound to blockIdx.x: a chunk kernel runs one
thread block per (batch, head, chunk), a scan, carry or decode kernel one per (batch, head)."""
from ...common import independent_outer_loops


def block_per_outer(sch, func_name):
    """Bind the fused independent outer loops to blockIdx.x; returns that loop (None when the
    function has none: it then runs as one thread block)."""
    loops = independent_outer_loops(sch)
    if not loops:
        return None
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    sch.bind(fused, "blockIdx.x")
    return fused
