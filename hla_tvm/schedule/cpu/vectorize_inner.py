"""Rule: give every GEMM-shaped block a register-tiled inner loop nest.

For a block C[.., i, j] += A[.., i, r] * B[.., r, j] the own loops (i, j, r) become
    i_outer, r, i_inner (unrolled, ROWS rows), j (vectorized)
so ROWS vector rows of C stay in registers while r runs; the reduction's init is split off
in front of the r loop. Element-wise blocks just get their innermost loop vectorized."""

from .common import COMM_REDUCE, DATA_PAR, static_extent

ROWS = 4  # accumulator rows kept in registers (ROWS x j vectors)


def _blocks(sch):
    return sch.get_child_blocks(sch.get_sblock("root"))


def _own_loops(sch, block):
    """The loops that enclose `block` and no other block (innermost last)."""
    own = []
    for loop in reversed(sch.get_loops(block)):
        if len(sch.get_child_blocks(loop)) != 1:
            break
        own.append(loop)
    return own[::-1]


def _dominant(sch, block):
    """True when no other block writes the buffers `block` writes (needed to split off its init)."""
    mine = [r.source for r in sch.get(block).writes]
    for other in _blocks(sch):
        if other.same_as(block):
            continue
        if any(r.source.same_as(b) for r in sch.get(other).writes for b in mine):
            return False
    return True


def vectorize_inner(sch, func_name, rows=ROWS):
    for block in list(_blocks(sch)):
        loops = _own_loops(sch, block)
        if not loops:
            continue
        iters = sch.get(block).iter_vars[-len(loops):]
        spatial = [lp for lp, iv in zip(loops, iters) if iv.iter_type == DATA_PAR]
        reduce_ = [lp for lp, iv in zip(loops, iters) if iv.iter_type == COMM_REDUCE]
        if not spatial:
            continue
        init_at = None
        if reduce_:
            inner_rows = []
            ext = static_extent(sch, spatial[-2]) if len(spatial) > 1 else None
            if ext and rows > 1 and ext % rows == 0:
                outer, inner = sch.split(spatial[-2], factors=[None, rows])
                spatial = spatial[:-2] + [outer, spatial[-1]]
                inner_rows = [inner]
            sch.reorder(*spatial[:-1], *reduce_, *inner_rows, spatial[-1])
            if inner_rows:
                # accumulate a ROWS x j tile in a local buffer, written back once per tile
                acc = sch.cache_write(block, 0, "local")
                sch.reverse_compute_at(acc, spatial[-2])
                sch.vectorize(_own_loops(sch, acc)[-1])
                sch.unroll(inner_rows[0])
            if sch.get(block).init is not None and _dominant(sch, block):
                init_at = reduce_[0]
        sch.vectorize(spatial[-1])
        if init_at is not None:
            # split the init off last: the primitives above need the block whole
            sch.decompose_reduction(block, init_at)
