"""Rule for matmuls with the reduction on the outer axis of the right operand, as the projections
of a model legalize (x [.., T, K] times a weight [K, N]), with their injective epilogues:

    C[.., i, j] = sum_k A[.., i, k] B[.., k, j];   out = f(C, ...) element-wise

Each output tile (ROWS rows x COLS columns) accumulates in registers; the loops become
    parallel(j_outer, lead.., i_outer), k, i_inner (unrolled), j_inner (vectorized)
with j_outer first when one W serves every leading index (a thread keeps its W slice in cache
over the whole batch) and after the leading axes when W has its own. One B row segment of COLS
floats feeds ROWS rows per load; the tile is written once, through the epilogue (inlined into
the write-back), so the product never makes a round trip to memory.
dlight's CPU rules take inner reductions (x times a [N, K] weight, norms); this takes the rest."""
from __future__ import annotations

from tvm import s_tir
from tvm.s_tir import dlight as dl

from .common import COMM_REDUCE, DATA_PAR, inline_elementwise, is_elementwise, static_extent

COLS = (64, 32, 16, 8)  # column tile: the first that divides N
TILE = 64               # floats per register tile: ROWS = TILE // COLS rows


def _is_var(expr, var):
    return expr.same_as(var)


def is_outer_matmul(block):
    """True when `block` is C[.., i, j] += A[.., i, k] * B[.., k, j]: iterators (.., i, j, k)
    with k the only reduction."""
    iters = block.iter_vars
    kinds = [iv.iter_type for iv in iters]
    if kinds.count(COMM_REDUCE) != 1 or any(k not in (DATA_PAR, COMM_REDUCE) for k in kinds):
        return False
    ki = kinds.index(COMM_REDUCE)
    if ki != len(iters) - 1 or len(iters) < 3 or len(block.writes) != 1 or len(block.reads) < 2:
        return False
    i, j, k = iters[-3].var, iters[-2].var, iters[-1].var
    out = [r.min for r in block.writes[0].region]
    if len(out) < 2 or not _is_var(out[-1], j) or not _is_var(out[-2], i):
        return False
    idx = [[r.min for r in rd.region] for rd in block.reads]
    has_a = any(len(x) >= 2 and _is_var(x[-1], k) and _is_var(x[-2], i) for x in idx)
    has_b = any(len(x) >= 2 and _is_var(x[-1], j) and _is_var(x[-2], k) for x in idx)
    return has_a and has_b


def _weight_shared(block):
    """True when the B operand (read as B[k, j]) has no leading axes."""
    k, j = block.iter_vars[-1].var, block.iter_vars[-2].var
    return any(len(r.region) == 2 and _is_var(r.region[0].min, k) and _is_var(r.region[1].min, j)
               for r in block.reads)


def _column_tile(n, choices=COLS):
    return next((c for c in choices if n is not None and n % c == 0), None)


class MatmulTiles(dl.ScheduleRule):
    """dlight rule: register-tiled outer-reduction matmul plus its element-wise epilogue."""

    def __init__(self, rows=None, cols=COLS):
        self.rows, self.cols = rows, cols

    def apply(self, func, target, _tunable):
        try:
            return self._apply(func)
        except (s_tir.ScheduleError, ValueError):
            return None  # a shape the primitives refuse: the rules after this one take it

    def _apply(self, func):
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        mm = [b for b in blocks if is_outer_matmul(sch.get(b))]
        if len(mm) != 1 or not all(is_elementwise(sch, b) for b in blocks if not b.same_as(mm[0])):
            return None
        block = mm[0]
        producers = blocks[:[b.same_as(block) for b in blocks].index(True)]
        if inline_elementwise(sch, producers):
            return None  # a producer (a transpose of an operand, say) that cannot inline
        loops = sch.get_loops(block)
        if len(loops) != len(sch.get(block).iter_vars):
            return None
        *lead, i, j, k = loops
        cols = _column_tile(static_extent(sch, j), self.cols)
        if cols is None:
            return None
        shared = _weight_shared(sch.get(block))
        jo, ji = sch.split(j, factors=[None, cols])
        rows = self.rows or max(1, TILE // cols)
        rows_ext = static_extent(sch, i)
        if rows > 1 and (rows_ext is None or (rows_ext % rows == 0 and rows_ext > 1)):
            io, ii = sch.split(i, factors=[None, rows])
        else:
            io, ii = i, None
        # a W shared by all leading indices (x [B, T, K] @ W [K, N]): column tiles outermost,
        # so a thread keeps its K x COLS slice of W in cache over every row of every batch
        outer = [jo, *lead, io] if shared else [*lead, jo, io]
        sch.reorder(*outer, k, *([ii] if ii is not None else []), ji)
        tile = sch.fuse(*outer)
        sch.parallel(tile)
        acc = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(acc, tile)
        epilogue = [b for b in sch.get_child_blocks(sch.get_sblock("root"))
                    if not b.same_as(block) and not b.same_as(acc)]
        inline_elementwise(sch, epilogue, reverse=True)  # the last one into the write-back
        for b in sch.get_child_blocks(sch.get_sblock("root")):
            if not b.same_as(block) and not b.same_as(acc) and not _under(sch, b, tile):
                sch.reverse_compute_at(b, tile)
        for b in sch.get_child_blocks(tile):
            if b.same_as(block):
                continue
            inner = sch.get_loops(b)[-1]
            if static_extent(sch, inner) == cols:
                sch.vectorize(inner)
        if ii is not None:
            sch.unroll(ii)
        sch.vectorize(ji)
        sch.decompose_reduction(block, k)  # the init inherits the vectorized column loop
        return sch


def _under(sch, block, loop):
    target = sch.get(loop)
    return any(sch.get(lp).same_as(target) for lp in sch.get_loops(block))
