"""Rule: fuse the perfectly nested outermost loops (batch, head[, chunk]) and run them in parallel,
as far down as every iteration writes elements of its own."""
from ...common import independent_outer_loops


def parallel_outer(sch, func_name):
    """Fuse the outer loop chain of the function and mark it parallel, down to the first loop
    that some block binds to a non-data-parallel iterator or to one its writes do not depend on
    (a sequential scan over chunks, an in-place state update): those stay serial inside."""
    loops = independent_outer_loops(sch)
    if not loops:
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    sch.parallel(fused)
