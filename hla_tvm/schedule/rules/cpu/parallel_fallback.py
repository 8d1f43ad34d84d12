"""Rule for the legalized Relax ops around the HLA kernels (projections, norms, logits) that
dlight's CPU GEMV/Reduction rules do not take:
  - element-wise chains are inlined into their last block first (one pass over memory);
  - element-wise blocks: innermost row vectorized; the leading loops run in parallel only when
    the static part of the work is at least PARALLEL_MIN elements (a parallel launch costs
    microseconds, more than a decode step's 256-element row takes serially), or in a function
    only a prefill runs (`schedule.common.MANY_ROWS`, `compiler.passes.prefill_rows`: its symbolic extent is the prompt);
  - reductions whose last data-parallel loop has a static extent (matmul C[.., j] += A[.., k]
    B[k, j]): that loop is split into a parallel outer part and a vectorized row of ROW elements,
    the reduction runs between them, so each thread streams rows of B into a row of C.
A function without a root block (TVM's legalizer emits cumsum and scatter_elements as one opaque
block of loops, parallel where it chose) or one a primitive refuses is left as it is; loops whose
symbolic extents TVM cannot fuse (a product of two sizes) run the first of them in parallel."""
from __future__ import annotations

from tvm import s_tir
from tvm.s_tir import dlight as dl

from ...common import (
    COMM_REDUCE,
    DATA_PAR,
    MANY_ROWS,
    inline_elementwise,
    root_blocks,
    static_extent,
)

VECTOR = 16
ROW = 64
PARALLEL_MIN = 1 << 15


class ParallelFallback(dl.ScheduleRule):
    def apply(self, func, target, _tunable):
        """The schedule above, or None (the function left as it is: correct serial code) for
        a function without a root block (the legalizer's cumsum, scatter_elements) or one a
        primitive refuses."""
        try:
            return self._schedule(s_tir.Schedule(func))
        except (s_tir.ScheduleError, RuntimeError):   # (TVM's internal errors are RuntimeErrors)
            return None

    def _schedule(self, sch):
        if not root_blocks(sch):
            return None
        inline_elementwise(sch, root_blocks(sch))
        for block in root_blocks(sch):
            loops = sch.get_loops(block)
            iters = sch.get(block).iter_vars
            if not loops or len(iters) != len(loops):
                continue  # not bound one-to-one to its loops; leave it serial
            kinds = [iv.iter_type for iv in iters]
            spatial = [lp for lp, k in zip(loops, kinds) if k == DATA_PAR]
            reduce_ = [lp for lp, k in zip(loops, kinds) if k == COMM_REDUCE]
            if len(spatial) + len(reduce_) != len(loops) or not spatial:
                continue
            if reduce_:
                self._reduction(sch, block, spatial, reduce_)
            else:
                self._elementwise(sch, spatial)
        return sch

    @staticmethod
    def _elementwise(sch, spatial):
        # a symbolic extent counts as one row, or, in a function only a prefill runs
        # (`compiler.passes.prefill_rows`), as the prompt's many
        many = MANY_ROWS in (sch.mod["main"].attrs or {})
        work = 1
        for lp in spatial:
            work *= static_extent(sch, lp) or (PARALLEL_MIN if many else 1)
        ext = static_extent(sch, spatial[-1])
        if ext and ext % VECTOR == 0 and ext > VECTOR:
            outer, inner = sch.split(spatial[-1], factors=[None, VECTOR])
            sch.vectorize(inner)
            spatial = spatial[:-1] + [outer]
        if work >= PARALLEL_MIN:
            _parallel(sch, spatial)

    @staticmethod
    def _reduction(sch, block, spatial, reduce_):
        ext = static_extent(sch, spatial[-1])
        if not ext or ext % VECTOR:
            lead = spatial  # e.g. a row reduction: parallel rows, serial reduction
            sch.reorder(*spatial, *reduce_)
            _parallel(sch, lead)
            return
        row = ROW if ext % ROW == 0 else VECTOR
        outer, inner = sch.split(spatial[-1], factors=[None, row])
        lead = spatial[:-1] + [outer]
        sch.reorder(*lead, *reduce_, inner)
        sch.vectorize(inner)
        _parallel(sch, lead)
        if sch.get(block).init is not None:
            sch.decompose_reduction(block, reduce_[0])



def _parallel(sch, loops):
    """`loops` (adjacent, outermost first) fused into one parallel loop; where TVM cannot fuse
    them (symbolic extents whose product it cannot split again: an InternalError from its
    iterator maps), the first alone runs in parallel."""
    if len(loops) > 1:
        try:
            sch.parallel(sch.fuse(*loops))
            return
        except RuntimeError:
            pass
    sch.parallel(loops[0])
