"""Rule: vectorize the innermost data-parallel loop of every block not yet scheduled.

Element-wise blocks get their innermost loop vectorized. A reduction (a matrix-vector product,
a row sum, a GEMM `chunk_gemm` left alone) has its reduction loops moved outside the last
data-parallel loop, which is vectorized, and its init split off in front of them."""
from tvm.tirx import ForKind

from ...common import (
    COMM_REDUCE,
    DATA_PAR,
    loop_iter_types,
    own_loops,
    root_blocks,
    writes_alone,
)


def vectorize_inner(sch, func_name):
    for block in root_blocks(sch):
        loops = own_loops(sch, block)
        if not loops or sch.get(loops[-1]).kind in (ForKind.VECTORIZED, ForKind.UNROLLED):
            continue  # no own loops, or already scheduled (chunk_gemm; tensorized: unrolled)
        kinds = loop_iter_types(sch, block, loops)
        spatial = [lp for lp, k in zip(loops, kinds) if k == DATA_PAR]
        reduce_ = [lp for lp, k in zip(loops, kinds) if k == COMM_REDUCE]
        if not spatial:
            continue
        if reduce_:
            sch.reorder(*spatial[:-1], *reduce_, spatial[-1])
        sch.vectorize(spatial[-1])
        if reduce_ and sch.get(block).init is not None and writes_alone(sch, block):
            sch.decompose_reduction(block, reduce_[0])
