"""Rule for matmuls with the reduction on the outer axis of the right operand, as the projections
of a model legalize (x [.., T, K] times a weight [K, N]), with their injective epilogues:

    C[.., i, j] = sum_k A[.., i, k] B[.., k, j];   out = f(C, ...) element-wise

Each output tile (ROWS rows x COLS columns, `tile_shape`) accumulates in registers; the loops
become
    parallel(j_outer, lead..), i_outer, k, i_inner (unrolled), j_inner (vectorized)
with j_outer first when one W serves every leading index (a thread keeps its K x COLS slice of W
in cache over the whole batch) and after the leading axes when W has its own. One row per batch
entry (a decode step of several streams, x [B, 1, K]): the entries are the rows (BATCH_ROWS). A
symbolic row count (the prompt length, the batch) is split into whole tiles and one predicated
tail (loop partition).
One B row segment of COLS floats feeds ROWS rows per load; the tile is written once, through the
epilogue (inlined into the write-back), so the product never makes a round trip to memory. A
packed weight (`hla_tvm.quant`) is dequantized in the inner loop for one row (a decode step),
and for more rows once per column tile, K x COLS floats under the parallel column loop (the
leading axes then run inside it), which every row tile reads as a float32 weight.
dlight's CPU rules take inner reductions (x times a [N, K] weight, norms); this takes the rest."""
from __future__ import annotations

from tvm import s_tir
from tvm.s_tir import dlight as dl
from tvm.target import codegen

from ....quant.kernels import DEQUANTIZE
from ...common import (
    COMM_REDUCE,
    DATA_PAR,
    inline_elementwise,
    is_elementwise,
    joint_extent,
    reads_pairs,
    root_blocks,
    static_extent,
    under,
)

MODEL_MATMUL = "hla_tvm.matmul_tiles"   # attribute of a model projection tuned with this rule
# one row (a decode step): wide column tiles stream W rows; the default is the widest dividing N
# of at most ROW_VECTORS vectors (64 columns below AVX-512): on AVX-512, 128 columns read a
# 25 MB head 1.8x faster than 64 and a 200 MB weight from memory 1.2x (24 against 20 GB/s)
ROW_COLS = (64, 32, 16, 8, 128)   # (the order tuning records index: new widths go last)
ROW_VECTORS = 8
# one row per batch entry (a decode step of several streams): the entries are the tile's rows,
# BATCH_ROWS at a time, over the one-row tile's columns, so a weight read serves two entries.
# Measured (Zen 4, K 3072 x N 8192 float32 in panels): 8 entries 37.2 -> 7.9 ms, one entry
# 4.94 -> 4.98 ms (its tile's second row predicated off); 4 rows spilled (K 768 x N 3072, 8
# entries: 0.94 against 0.42 ms for 2). On AVX2 (16 registers, 64 columns) the tile's 16
# accumulators take every register, still measured ahead (AVX2 code on the Zen 4: one entry
# 4.06 -> 4.18 ms, 8 entries 32.8 -> 10.6). The parallel loop is then the column tiles alone.
BATCH_ROWS = 2
ACCUMULATORS = 12           # vector registers a tile may hold (AVX2 has 16, AVX-512 32)


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


def _column_tile(n, choices):
    return next((c for c in choices if n is not None and n % c == 0), None)


def vector_lanes(target):
    """float32 lanes of the target's widest vector unit (16 AVX-512, 8 AVX2, 4 SSE/NEON)."""
    for feature, lanes in (("avx512f", 16), ("avx2", 8), ("avx", 8)):
        try:
            if codegen.target_has_features(feature, target):
                return lanes
        except Exception:  # noqa: BLE001 - a target LLVM cannot query
            break
    return 4


def tile_shape(rows_ext, n, lanes):
    """(rows, cols) of the register tile for a row count `rows_ext` (None: symbolic) and N = `n`:
    one row -> the widest of ROW_COLS dividing N within ROW_VECTORS vectors (at least 64
    columns); more -> two vectors of columns (one when that does not divide N) and as many rows
    as ACCUMULATORS registers allow."""
    if rows_ext == 1:
        widths = sorted((c for c in ROW_COLS if c <= max(64, ROW_VECTORS * lanes)), reverse=True)
        return 1, _column_tile(n, widths)
    cols = _column_tile(n, (2 * lanes, lanes, 8))
    return (max(1, ACCUMULATORS // max(1, (cols or 1) // lanes)), cols)


def tile_choices(rows_ext, n, lanes):
    """(rows candidates, cols candidates) a tuner may pick the tile from: one row -> the
    ROW_COLS dividing N; more -> 2 to 16 rows (dividing a static row count) and one or two
    vectors of columns."""
    if rows_ext == 1:
        return [1], [c for c in ROW_COLS if n % c == 0]
    rows = [r for r in (2, 3, 4, 5, 6, 8, 10, 12, 16) if rows_ext is None or rows_ext % r == 0]
    return rows, [c for c in (lanes, 2 * lanes) if n % c == 0]


def schedule(sch, lanes, tunable=False, rows=None, cols=None):
    """Schedule the function the Schedule `sch` works on as a register-tiled matmul with its
    epilogue (the module docstring); False, leaving `sch` untouched, where it is no such
    matmul (ValueError or ScheduleError, `sch` then spoilt, where a primitive refuses it).
    tunable: the tile's rows and columns are sampled decisions (`tile_choices`) starting at the
    default tile (`tile_shape`); rows, cols: a fixed tile."""
    blocks = root_blocks(sch)
    mm = [b for b in blocks if is_outer_matmul(sch.get(b))]
    if len(mm) != 1 or not all(is_elementwise(sch, b) for b in blocks if not b.same_as(mm[0])):
        return False
    block = mm[0]
    loops = sch.get_loops(block)
    if len(loops) != len(sch.get(block).iter_vars) or len(loops) < 3:
        return False
    rows_ext, n = static_extent(sch, loops[-3]), static_extent(sch, loops[-2])
    d_rows, d_cols = tile_shape(rows_ext, n, lanes)
    shared = _weight_shared(sch.get(block))
    entries = joint_extent(sch, loops[:-3])
    # one row per batch entry, the entries more than one or symbolic: they become the rows
    batch = rows_ext == 1 and shared and (entries is None or entries > 1)
    if batch:
        d_rows, rows_ext = BATCH_ROWS, entries
    rows, cols = rows or d_rows, cols or d_cols
    if cols is None or n is None or n % cols:
        return False
    # tuning specializes the rows to one length; the tile must serve every length (symbolic)
    symbolic = rows_ext is None or (tunable and rows_ext != 1)
    if not symbolic:   # the largest tile height that divides the rows
        rows = max(r for r in range(1, min(rows, rows_ext) + 1) if rows_ext % r == 0)
    producers = blocks[:[b.same_as(block) for b in blocks].index(True)]
    # rows sharing a packed weight (prefill): its column tile dequantized once for all of them
    packed = [b for b in producers if _unpacks(sch.get(b))] if shared and not batch and \
        (symbolic or rows > 1) else []
    if inline_elementwise(sch, [b for b in producers if not any(b.same_as(p) for p in packed)]):
        raise ValueError("a producer that cannot inline")   # (the caller's schedule is spoilt)
    if tunable:   # (batch rows: the columns of the one-row tile's choices, BATCH_ROWS rows)
        rows_c, cols_c = tile_choices(1 if batch else None if symbolic else rows_ext, n, lanes)
        rows = rows if batch else _sample(sch, rows_c, rows)
        cols = _sample(sch, cols_c, cols)
    *lead, i, j, k = sch.get_loops(block)
    if batch:   # the batch axes and the one row fused into the row axis
        lead, i = [], sch.fuse(*lead, i)
    jo, ji = sch.split(j, factors=[None, cols])
    if symbolic or rows > 1:
        io, ii = sch.split(i, factors=[None, rows])
    else:
        io, ii = i, None
    outer = [jo, *lead] if shared else [*lead, jo]
    sch.reorder(*outer, io, k, *([ii] if ii is not None else []), ji)
    # (a packed weight's tile under the column loop alone: fused with a symbolic batch, its
    # region is not found)
    par = jo if packed else sch.fuse(*outer) if len(outer) > 1 else outer[0]
    sch.parallel(par)
    for b in packed:
        sch.compute_at(b, par)
        sch.vectorize(sch.get_loops(b)[-1])
    if ii is not None and symbolic:
        # a symbolic row count: whole tiles, then one predicated tail
        sch.annotate(io, "pragma_loop_partition_hint", 1)
    acc = sch.cache_write(block, 0, "global")  # small: a stack array LLVM keeps in registers
    sch.reverse_compute_at(acc, io)
    # (by name: the handles of one block from two calls differ)
    kept = {sch.get(b).name_hint for b in (block, acc, *packed)}
    epilogue = [b for b in root_blocks(sch)
                if sch.get(b).name_hint not in kept]
    inline_elementwise(sch, epilogue, reverse=True)  # the last one into the write-back
    for b in root_blocks(sch):
        if sch.get(b).name_hint not in kept and not under(sch, b, io):
            sch.reverse_compute_at(b, io)
    for b in sch.get_child_blocks(io):
        if sch.get(b).name_hint == sch.get(block).name_hint:
            continue
        inner = sch.get_loops(b)[-1]
        if static_extent(sch, inner) == (cols if isinstance(cols, int) else int(sch.get(cols))):
            sch.vectorize(inner)
    if ii is not None:
        sch.unroll(ii)
    sch.vectorize(ji)
    if reads_pairs(sch.get(block)):
        # two rows of the weight a byte (int4): the reduction by twos, unrolled, so each byte
        # is loaded once and each nibble's select is decided when compiling
        k, kp = sch.split(k, factors=[None, 2])
        sch.unroll(kp)
    sch.decompose_reduction(block, k)  # the init inherits the vectorized column loop
    return True


def _unpacks(block):
    """Whether `block` is a weight's dequantization (`quant.kernels.DEQUANTIZE`)."""
    return block.name_hint == DEQUANTIZE and \
        any(str(r.source.dtype) != "float32" for r in block.reads)


def _sample(sch, choices, default):
    """`default`, or a categorical decision over `choices` starting at it."""
    if default not in choices or len(choices) == 1:
        return default
    return sch.sample_categorical([int(c) for c in choices], [1.0 / len(choices)] * len(choices),
                                  decision=choices.index(default))


class MatmulTiles(dl.ScheduleRule):
    """dlight rule: register-tiled outer-reduction matmul plus its element-wise epilogue."""

    def __init__(self, rows=None, cols=None):
        self.rows, self.cols = rows, cols   # fixed tile (tests, experiments); None: tile_shape

    def apply(self, func, target, _tunable):
        try:
            sch = s_tir.Schedule(func)
            return sch if schedule(sch, vector_lanes(target), rows=self.rows,
                                   cols=self.cols) else None
        except (s_tir.ScheduleError, ValueError):
            return None  # a shape the primitives refuse: the rules after this one take it
