"""Rule for a decode step's product with int8 or int4 weights (`quant.kernels.group_matvec`),
with its element-wise epilogue:

    partial[.., g, n] = sum_{k in group g} x[.., k] v[k, n];
    out[.., n] = sum_g s[g, n] (partial[.., g, n] - o xsum[.., g])

Loops: parallel(n_outer), batch.., g, then the group's sum (k, n_inner) beside the scaled
accumulation (n_inner): a column tile of the one-row tile's width (`matmul_tiles.tile_shape`,
the weights' panel width) keeps its partial sums and its accumulators in vector registers, so
each weight is read and converted once and multiplied by no scale (one multiply-add a group and
column does that). Several batch entries run `matmul_tiles.BATCH_ROWS` at a time (the tile's
rows, unrolled inside k): one conversion of a weight serves them (int4: in a symbolic batch's
kernel; a static batch of one keeps one entry). An int4 weight's sum runs by row pairs,
unrolled, so one byte load feeds both nibbles. Speed:
docs/cpu_schedules.md."""
from __future__ import annotations

from tvm import s_tir
from tvm.s_tir import dlight as dl

from ....quant.kernels import GROUP_PARTIAL, GROUP_SCALED, GROUP_SUM
from ...common import (
    inline_elementwise,
    is_elementwise,
    joint_extent,
    reads_pairs,
    root_blocks,
    static_extent,
    under,
)
from .matmul_tiles import BATCH_ROWS, tile_shape, vector_lanes


def schedule(sch, lanes):
    """Schedule the function of `sch` as above; False, `sch` untouched, where it is not a
    group_matvec with only element-wise blocks after it."""
    blocks = root_blocks(sch)
    names = [sch.get(b).name_hint for b in blocks]
    if GROUP_SCALED not in names or GROUP_PARTIAL not in names:
        return False
    # element-wise producers fused before the product: inlined into their readers
    producers = [b for b, name in zip(blocks, names[:names.index(GROUP_SCALED)])
                 if name not in (GROUP_SUM, GROUP_PARTIAL)]
    if producers and inline_elementwise(sch, producers):
        return False
    blocks = root_blocks(sch)
    names = [sch.get(b).name_hint for b in blocks]
    last = names.index(GROUP_SCALED)
    # before it the partial sums and int4's sums of x per group (left serial: small)
    if set(names[:last]) - {GROUP_SUM, GROUP_PARTIAL} or \
            not all(is_elementwise(sch, b) for b in blocks[last + 1:]):
        return False
    part, out, epilogue = blocks[names.index(GROUP_PARTIAL)], blocks[last], blocks[last + 1:]
    *lead, n, g = sch.get_loops(out)
    cols = tile_shape(1, static_extent(sch, n), lanes)[1]
    if cols is None:
        return False
    no, ni = sch.split(n, factors=[None, cols])
    entries = joint_extent(sch, lead)
    rows = None
    pairs = reads_pairs(sch.get(part))
    # batch entries: BATCH_ROWS at a time, sharing each weight's conversion; int4 only where
    # the batch is symbolic, as one stream runs a static entry of its own (`compiler.
    # with_decode_one`): in a symbolic batch's kernel two at a time made one entry slower (the
    # predicated second row; docs/cpu_schedules.md)
    if entries is None or (entries > 1 and not pairs):
        bo, rows = sch.split(sch.fuse(*lead), factors=[None, BATCH_ROWS])
        lead = [bo]
        sch.reorder(no, bo, g, rows, ni)
        if entries is None:   # whole tiles, then one predicated tail
            sch.annotate(bo, "pragma_loop_partition_hint", 1)
    else:
        sch.reorder(no, *lead, g, ni)
    sch.parallel(no)
    acc = sch.cache_write(out, 0, "global")   # a stack array LLVM keeps in registers
    sch.reverse_compute_at(acc, lead[-1])
    after = {sch.get(b).name_hint for b in epilogue}   # (handles differ between calls)
    inline_elementwise(sch, epilogue, reverse=True)
    for b in root_blocks(sch):
        if sch.get(b).name_hint in after and not under(sch, b, lead[-1]):
            sch.reverse_compute_at(b, lead[-1])
    sch.compute_at(part, g)
    loops = sch.get_loops(part)
    pn, pk = loops[-2], loops[-1]
    prow = None if rows is None else \
        next((lp for lp in reversed(loops[:-2]) if static_extent(sch, lp) == BATCH_ROWS), None)
    if rows is not None and prow is None:
        raise ValueError("the partial sums hold no loop over the tile's rows")
    if prow is None:
        sch.reorder(pk, pn)
    else:   # a weight's value read and converted once for the tile's rows
        sch.reorder(pk, prow, pn)
        sch.unroll(prow)
    if pairs:
        pk, pair = sch.split(pk, factors=[None, 2])
        sch.unroll(pair)
        # the column loops of the sums vectorized here: after the reductions' inits are split
        # off the primitive refuses them, and LLVM's own vectorizer did less (the 120 M model's
        # int4 step: docs/cpu_schedules.md)
        for blk in (part, out):
            inner = sch.get_loops(blk)[-1]
            if static_extent(sch, inner) == cols:
                sch.vectorize(inner)
    sch.decompose_reduction(part, pk)
    sch.decompose_reduction(out, g)
    for b in sch.get_child_blocks(lead[-1]):   # the column loops the primitive takes
        inner = sch.get_loops(b)[-1]
        if static_extent(sch, inner) == cols:
            try:
                sch.vectorize(inner)
            except s_tir.ScheduleError:
                pass
    return True


class GroupMatvec(dl.ScheduleRule):
    """dlight rule: `schedule` for a decode step's int8 / int4 product."""

    def apply(self, func, target, _tunable):
        try:
            sch = s_tir.Schedule(func)
            return sch if schedule(sch, vector_lanes(target)) else None
        except (s_tir.ScheduleError, ValueError):
            return None
