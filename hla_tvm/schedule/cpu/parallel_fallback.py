"""Rule for the legalized Relax ops around the HLA kernels (projections, norms, logits) that
dlight's CPU GEMV/Reduction rules do not take:
  - element-wise blocks: leading loops in parallel, innermost row vectorized;
  - reductions whose last data-parallel loop has a static extent (matmul C[.., j] += A[.., k]
    B[k, j]): that loop is split into a parallel outer part and a vectorized row of ROW elements,
    the reduction runs between them, so each thread streams rows of B into a row of C."""
from __future__ import annotations

from tvm import s_tir
from tvm.s_tir import dlight as dl

DATA_PAR, COMM_REDUCE = 0, 2
VECTOR = 16
ROW = 64


def _static(sch, loop):
    ext = sch.get(loop).extent
    return int(ext.value) if hasattr(ext, "value") else None


class ParallelFallback(dl.ScheduleRule):
    def apply(self, func, target, _tunable):
        sch = s_tir.Schedule(func)
        for block in sch.get_child_blocks(sch.get_sblock("root")):
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
        ext = _static(sch, spatial[-1])
        if ext and ext % VECTOR == 0 and ext > VECTOR:
            outer, inner = sch.split(spatial[-1], factors=[None, VECTOR])
            sch.vectorize(inner)
            spatial = spatial[:-1] + [outer]
        sch.parallel(sch.fuse(*spatial) if len(spatial) > 1 else spatial[0])

    @staticmethod
    def _reduction(sch, block, spatial, reduce_):
        ext = _static(sch, spatial[-1])
        if not ext or ext % VECTOR:
            lead = spatial  # e.g. a row reduction: parallel rows, serial reduction
            sch.reorder(*spatial, *reduce_)
            sch.parallel(sch.fuse(*lead) if len(lead) > 1 else lead[0])
            return
        row = ROW if ext % ROW == 0 else VECTOR
        outer, inner = sch.split(spatial[-1], factors=[None, row])
        lead = spatial[:-1] + [outer]
        sch.reorder(*lead, *reduce_, inner)
        sch.vectorize(inner)
        sch.parallel(sch.fuse(*lead) if len(lead) > 1 else lead[0])
        if sch.get(block).init is not None:
            sch.decompose_reduction(block, reduce_[0])
