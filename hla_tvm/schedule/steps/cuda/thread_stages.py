"""Rule: the threads of a block share out each stage's output elements.

Every block (stage) under the thread-block loop has its data-parallel loops fused and split
over the block's threads (threadIdx.x), a predicate masking the tail; its reduction loops run
inside, each thread summing its own elements in registers ("local"), written back once (with
`registers`: a kernel updating its state in place is no stage pipeline, where TVM cannot place
the register tile; its sums go to their buffer directly, and `stage_threads` picks a thread
count that needs no predicate there). A matrix-product stage (two output loops) sums a tile
of adjacent outputs per thread (`TILES`: up to 4 x 4, 16 independent sums per step, each
operand element loaded once for 4 of them) where its outputs leave every thread a tile.

A stage computing one value into a register (a dot product of a decode, a chunk's total decay:
`shared_scratch`) is left to every thread; a stage writing one value elsewhere runs on thread 0."""
from __future__ import annotations

import math

from tvm import s_tir, tirx

from ...common import (
    COMM_REDUCE,
    DATA_PAR,
    among,
    loop_iter_types,
    own_loops,
    root_blocks,
    root_scratch,
    static_extent,
    walk,
    with_children,
    writes_alone,
)


def _spatial_reduce(sch, block):
    loops = own_loops(sch, block)
    kinds = loop_iter_types(sch, block, loops)
    return ([lp for lp, k in zip(loops, kinds) if k == DATA_PAR],
            [lp for lp, k in zip(loops, kinds) if k == COMM_REDUCE])


def _summing_sizes(sch, loops=None):
    """The number of outputs of each stage that sums over static output loops (a reduction
    loop, or a loop inside its block: `hla2_decay.decode(columns=True)`), of `loops` output
    loops only when given."""
    sizes = []
    for block in root_blocks(sch):
        spatial, reduce_ = _spatial_reduce(sch, block)
        extents = [static_extent(sch, lp) for lp in spatial]
        inner = []
        walk(sch.get(block).body, lambda n: inner.append(n) if isinstance(n, tirx.For) else None)
        if spatial and (reduce_ or inner) and all(extents) and loops in (None, len(spatial)):
            sizes.append(math.prod(extents))
    return sizes


def stage_threads(sch, most):
    """Threads per block for a kernel updating its state in place: the largest count up to
    `most` that divides every summing stage's number of output elements, so that no sum runs
    under a predicate (TVM cannot place the barriers a sum into shared memory needs under one);
    element-wise stages may (their tail is masked)."""
    sizes = _summing_sizes(sch)
    count = math.gcd(*sizes) if sizes else most
    return max(d for d in range(1, min(count, most) + 1) if count % d == 0)


def product_threads(sch, most, fewest):
    """Threads per block for a kernel that is no in-place update: `most` where it has matrix
    products (stages with two output loops and a sum) and each has at least that many outputs,
    else `fewest` (decode kernels: no matrix products). (With more threads than such a stage's
    outputs, TVM 0.27 failed to place a barrier in second order's summary kernel at head size
    8: "Cannot insert syncs inside condition"; every family compiles at head sizes 8 to 128.)"""
    sizes = _summing_sizes(sch, loops=2)
    return most if sizes and min(sizes) >= most else fewest


# register tiles (rows, columns) a thread may sum, largest first. None with a unit side: tiled
# 1 x 2 or 2 x 1, the stage of second order's output kernel that ridge = 0 leaves unread (QQ,
# chunk 16) made TVM 0.27's shared-memory merging fail (InternalError: buffer_byte_offsets)
TILES = ((4, 4), (2, 4), (4, 2), (2, 2))


def _tile(sch, spatial, threads, tiles=TILES):
    """The register tile of a matrix-product stage with output loops `spatial` (rows, columns):
    the largest of `tiles` dividing both extents that still leaves every thread a tile; None
    (one element per thread) for other stages or where no tile leaves enough."""
    if len(spatial) != 2:
        return None
    rows, cols = (static_extent(sch, lp) for lp in spatial)
    if not rows or not cols:
        return None
    for rt, rc in tiles:
        if rows % rt == 0 and cols % rc == 0 and (rows // rt) * (cols // rc) >= threads:
            return rt, rc
    return None


def thread_stages(sch, func_name, threads, registers=True, tiles=TILES):
    """Schedule every stage of the root block as the module docstring says; returns
    {register write-back block name: its stage's block name} for the stages with a masked
    tail (`mask_write_backs` gives the write-backs the stage's mask)."""
    scratch = root_scratch(sch)
    tails = {}
    for block in root_blocks(sch):
        spatial, reduce_ = _spatial_reduce(sch, block)
        writes = sch.get(block).writes
        if not spatial and all(w.source.scope() == "local" and among(w.source, scratch)
                               for w in writes):
            continue   # one value in a register of every thread: each computes it itself
        summing = registers and bool(reduce_) and sch.get(block).init is not None and \
            writes_alone(sch, block)
        tile = _tile(sch, spatial, threads, tiles) if summing else None
        outputs = spatial
        if tile is not None:   # a thread sums rt x rc adjacent outputs: tile loops innermost
            (rt, rc), (i, j) = tile, spatial
            ip, ia = sch.split(i, [None, rt])
            jf, je = sch.split(j, [None, rc])
            sch.reorder(ip, jf, *reduce_, ia, je)
            outputs = [ip, jf]
        elif reduce_:
            sch.reorder(*spatial, *reduce_)
        fused = (sch.fuse(*outputs) if len(outputs) > 1 else outputs[0]) if outputs else \
            sch.add_unit_loop(block)
        extent = static_extent(sch, fused)
        _, inner = sch.split(fused, [None, threads])
        sch.bind(inner, "threadIdx.x")
        if summing:
            acc = sch.cache_write(block, 0, "local")
            sch.reverse_compute_at(acc, inner)
            if tile is not None:   # the tile's sums start at zero before the reduction
                init = sch.decompose_reduction(block, reduce_[0])
                for b in (block, init, acc):
                    for lp in sch.get_loops(b)[-2:]:
                        sch.unroll(lp)
            if not extent or extent % threads:
                tails[sch.get(acc).name_hint] = sch.get(block).name_hint
    return tails


def mask_write_backs(func, tails):
    """`func` with each register write-back block named in `tails` (`thread_stages`) under the
    predicate of its stage's block: TVM places a write-back over every thread of the stage's
    loop, the masked tail included, whose writes would land past the stage's elements (in
    another thread block's, or past the buffer)."""
    masks = {}

    def find(node):
        if isinstance(node, s_tir.SBlockRealize) and node.block.name_hint in tails.values():
            masks[node.block.name_hint] = node.predicate

    walk(func.body, find)

    def rebuild(stmt):
        out = with_children(stmt, rebuild)
        mask = masks.get(tails.get(stmt.block.name_hint)) \
            if isinstance(stmt, s_tir.SBlockRealize) else None
        return out if mask is None else s_tir.SBlockRealize(out.iter_values, mask, out.block)

    return func.with_body(rebuild(func.body)) if tails else func
