"""Rule: a register-tiled micro-kernel for every GEMM-shaped block of a chunk kernel.

For a block C[.., i, j] += A[.., i, r] * B[.., r, j] (i, j static; r the one reduction) the
block's own loops become
    i_outer, j_outer, r, i_inner (unrolled, ROWS), j_inner (vectorized, COLS)
with the ROWS x COLS tile of C in registers, its init in front of the r loop and its write-back
behind it. The tile is a small buffer of scope "global": TVM places those (under 1 kB) on the
stack, where LLVM promotes them to registers once unrolling makes every index constant; a
"local" buffer would come from the workspace allocator and be stored to memory every step.
COLS is two vector registers wide where that divides j (one otherwise); ROWS the largest divisor
of i's extent within the target's accumulator budget with the tile under 1 kB (`tile`)."""
from __future__ import annotations

import tvm

from ....ops.common.pairs import PAIR_PRODUCT
from ...common import (
    COMM_REDUCE,
    DATA_PAR,
    loop_iter_types,
    own_loops,
    root_blocks,
    static_extent,
    writes_alone,
)
from . import bf16_dot as bf16_dot_rule

# accumulator registers a tile may use: AVX-512 has 32 vector registers, AVX2 and NEON 16; the
# rest hold the B row segment and the broadcast A element
ACCUMULATORS = {16: 24, 8: 12, 4: 12}
# TVM puts a buffer on the stack only below this many bytes (`kMaxStackAlloca`); a tile of
# 1 kB or more comes from the workspace allocator, which LLVM cannot keep in registers: it
# stored every accumulator after each multiply-add (AVX-512's 8 x 32 float tile, 1024 bytes)
STACK_BYTES = 1024


def tile(rows_ext, cols_ext, lanes, elem_bytes=4):
    """(ROWS, COLS) of the register tile for a rows_ext x cols_ext output, `lanes` elements of
    elem_bytes per vector register; None when the columns do not split into whole vectors. The
    tile stays under STACK_BYTES."""
    cols = next((c for c in (2 * lanes, lanes) if cols_ext % c == 0), None)
    if cols is None:
        return None
    budget = min(ACCUMULATORS.get(lanes, 12) // (cols // lanes),
                 (STACK_BYTES - 1) // (cols * elem_bytes))
    if budget < 1:
        return None
    rows = max(r for r in range(1, min(budget, rows_ext) + 1) if rows_ext % r == 0)
    return rows, cols


def tile_choices(rows_ext, cols_ext, lanes):
    """(rows candidates, cols candidates) a tuner may pick the register tile from: the row
    counts from 2 dividing the output's rows up to 24 (AVX-512's accumulator budget) and one or
    two vector registers of columns; None when the columns do not split into whole vectors.
    (Tiles of STACK_BYTES or more are among them, as the shipped records' traces were sampled
    from this list; the tuner measures them.)"""
    cols = [c for c in (lanes, 2 * lanes) if cols_ext % c == 0]
    if not cols:
        return None
    # (a one-row tile has one loop fewer, which a recorded trace could not replay onto)
    return [r for r in range(2, min(24, rows_ext) + 1) if rows_ext % r == 0], cols


def _factor(sch, choices, default, tunable):
    """`default`, or with tunable a categorical sample over `choices` whose decision starts at
    `default` (a tuner's search then tries the others)."""
    if not tunable or default not in choices or len(choices) == 1:
        return default
    return sch.sample_categorical([int(c) for c in choices], [1.0 / len(choices)] * len(choices),
                                  decision=choices.index(default))


def gemm_loops(sch, block):
    """(spatial loops, reduction loop) of a GEMM-shaped block's own loops, or None."""
    loops = own_loops(sch, block)
    kinds = loop_iter_types(sch, block, loops)
    if kinds.count(COMM_REDUCE) != 1 or any(k not in (DATA_PAR, COMM_REDUCE) for k in kinds):
        return None
    spatial = [lp for lp, k in zip(loops, kinds) if k == DATA_PAR]
    if len(spatial) < 2 or sch.get(block).init is None:
        return None
    return spatial, loops[kinds.index(COMM_REDUCE)]


def _read_before(sch, block, blocks):
    """True when a block ahead of `block` reads what it writes (the tile's cache write would
    reorder a write after that read)."""
    me = sch.get(block)
    mine = [r.source for r in me.writes]
    for other in blocks:
        try:
            stmt = sch.get(other)
        except ValueError:   # a tensorized block (`bf16_dot`), replaced by its outer block
            continue
        if stmt.same_as(me):
            return False
        if any(r.source.same_as(b) for r in stmt.reads for b in mine):
            return True
    return False


def chunk_gemm(sch, func_name, lanes=8, tunable=False, bf16_dot=False):
    """Tile every GEMM-shaped block of `func_name` (see the module docstring); `lanes`: float32
    elements per vector register of the target. tunable: each tile's rows and columns are
    sampled decisions (`tile_choices`) starting at the default `tile`, for meta_schedule.
    bf16_dot: the target has AVX512-BF16, and the pair products of `ops.common.pairs` (the
    bfloat16 products of `bf16_products` kernels) run on its vdpbf16ps (`bf16_dot`); without it
    they are vectorized as written."""
    blocks = root_blocks(sch)
    for block in blocks:
        found = gemm_loops(sch, block)
        if found is None or not writes_alone(sch, block) or _read_before(sch, block, blocks):
            continue
        (*lead, i, j), r = found
        ie, je = static_extent(sch, i), static_extent(sch, j)
        bits = tvm.DataType(sch.get(block).writes[0].source.dtype).bits
        per_vector = max(1, lanes * 32 // bits)   # elements of the output's dtype
        shape = tile(ie, je, per_vector, bits // 8) if ie and je else None
        if shape is None:
            continue
        rows_choices, cols_choices = tile_choices(ie, je, per_vector)
        whole = [c for c in cols_choices if c % bf16_dot_rule.LANES == 0]   # vdpbf16ps pieces
        dot = bf16_dot and PAIR_PRODUCT in sch.get(block).annotations and bool(whole)
        if dot:
            cols_choices = whole
            if shape[1] not in whole:
                shape = (shape[0], whole[-1])
        rows = _factor(sch, rows_choices, shape[0], tunable)
        cols = _factor(sch, cols_choices, shape[1], tunable)
        io, ii = sch.split(i, factors=[None, rows])
        jo, ji = sch.split(j, factors=[None, cols])
        sch.reorder(*lead, io, jo, r, ii, ji)
        acc = sch.cache_write(block, 0, "global")
        sch.reverse_compute_at(acc, jo)
        *rows_loops, ac = own_loops(sch, acc)   # unit loops are gone for one-row tiles
        for lp in rows_loops:
            sch.unroll(lp)
        sch.vectorize(ac)
        sch.unroll(ii)
        if dot:
            bf16_dot_rule.tensorize(sch, block, ji, r, io)
            continue
        sch.vectorize(ji)
        sch.decompose_reduction(block, r)  # the init inherits the unrolled, vectorized loops
