"""Rule: the threads of a block share out each stage's output elements.

Every block (stage) under the thread-block loop has its data-parallel loops fused and split
over the block's threads (threadIdx.x), a predicate masking the tail; its reduction loops run
inside, each thread summing its own elements in registers ("local"), written back once (with
`registers`: a kernel updating its state in place is no stage pipeline, where TVM cannot place
the register tile; its sums go to their buffer directly, and `stage_threads` picks a thread
count that needs no predicate there). A matrix-product stage (two output loops) sums a tile
of adjacent outputs per thread (`TILES`: up to 4 x 4, 16 independent sums per step, each
operand element loaded once for 4 of them) where its outputs leave every thread a tile.

A stage computing one value into a register (`shared_scratch.hoist`: a dot product) is left
to every thread; a stage writing one value elsewhere runs on thread 0."""
from __future__ import annotations

import math

from ..common import COMM_REDUCE, DATA_PAR, among, loop_iter_types, own_loops, root_scratch, \
    static_extent, walk, with_children, writes_alone


def _spatial_reduce(sch, block):
    loops = own_loops(sch, block)
    kinds = loop_iter_types(sch, block, loops)
    return ([lp for lp, k in zip(loops, kinds) if k == DATA_PAR],
            [lp for lp, k in zip(loops, kinds) if k == COMM_REDUCE])


def stage_threads(sch, most):
    """Threads per block for a kernel updating its state in place: the largest count up to
    `most` that divides every summing stage's number of output elements, so that no sum runs
    under a predicate (TVM cannot place the barriers a sum into shared memory needs under one);
    element-wise stages may (their tail is masked)."""
    sizes = []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        spatial, reduce_ = _spatial_reduce(sch, block)
        extents = [static_extent(sch, lp) for lp in spatial]
        if spatial and reduce_ and all(extents):
            sizes.append(math.prod(extents))
    count = math.gcd(*sizes) if sizes else most
    return max(d for d in range(1, min(count, most) + 1) if count % d == 0)


def chunk_threads(sch, most, fewest):
    """Threads per block for a kernel that is no in-place update: `most` where it has matrix
    products (stages with two output loops and a sum) and each has at least that many outputs,
    else `fewest` (decode kernels: no matrix products). (With more threads than such a stage's
    outputs, TVM 0.27 failed to place a barrier in second order's summary kernel at head size
    8: "Cannot insert syncs inside condition".)"""
    sizes = []
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        spatial, reduce_ = _spatial_reduce(sch, block)
        extents = [static_extent(sch, lp) for lp in spatial]
        if len(spatial) == 2 and reduce_ and all(extents):
            sizes.append(math.prod(extents))
    return most if sizes and min(sizes) >= most else fewest


# register tiles (rows, columns) a thread may sum, largest first. None with a unit side: tiled
# 1 x 2 or 2 x 1, the stage of second order's output kernel that ridge = 0 leaves unread (QQ,
# chunk 16) made TVM 0.27's shared-memory merging fail (InternalError: buffer_byte_offsets)
TILES = ((4, 4), (2, 4), (4, 2), (2, 2))


def _tile(sch, spatial, threads):
    """The register tile of a matrix-product stage with output loops `spatial` (rows, columns):
    the largest of `TILES` dividing both extents that still leaves every thread a tile; None
    (one element per thread) for other stages or where no tile leaves enough."""
    if len(spatial) != 2:
        return None
    rows, cols = (static_extent(sch, lp) for lp in spatial)
    if not rows or not cols:
        return None
    for rt, rc in TILES:
        if rows % rt == 0 and cols % rc == 0 and (rows // rt) * (cols // rc) >= threads:
            return rt, rc
    return None


def _tiled(sch, block, spatial, reduce_, tile, threads):
    """Schedule the matrix-product stage `block` with each thread summing an rt x rc `tile` of
    adjacent outputs in registers (rt * rc independent sums per step of the reduction, each
    operand element loaded once for rt or rc of them); returns (name of the register
    write-back, True when the tiles do not fill the last round of threads: its tail is
    masked)."""
    (rt, rc), (i, j) = tile, spatial
    ip, ia = sch.split(i, [None, rt])
    jf, je = sch.split(j, [None, rc])
    sch.reorder(ip, jf, *reduce_, ia, je)
    fused = sch.fuse(ip, jf)
    tiles = static_extent(sch, fused)
    _, inner = sch.split(fused, [None, threads])
    sch.bind(inner, "threadIdx.x")
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, inner)
    init = sch.decompose_reduction(block, reduce_[0])
    for b in (block, init, acc):
        for lp in sch.get_loops(b)[-2:]:
            sch.unroll(lp)
    return sch.get(acc).name_hint, tiles % threads != 0


def thread_stages(sch, func_name, threads, registers=True):
    """Schedule every stage of the root block as the module docstring says; returns
    {register write-back block name: its stage's block name} for the stages with a masked
    tail (`mask_write_backs` gives the write-backs the stage's mask)."""
    scratch = root_scratch(sch)
    tails = {}
    for block in list(sch.get_child_blocks(sch.get_sblock("root"))):
        spatial, reduce_ = _spatial_reduce(sch, block)
        writes = sch.get(block).writes
        if not spatial and all(w.source.scope() == "local" and among(w.source, scratch)
                               for w in writes):
            continue   # one value in a register of every thread: each computes it itself
        tile = _tile(sch, spatial, threads) if registers and reduce_ and \
            sch.get(block).init is not None and writes_alone(sch, block) else None
        if tile is not None:
            name = sch.get(block).name_hint
            write_back, masked = _tiled(sch, block, spatial, reduce_, tile, threads)
            if masked:
                tails[write_back] = name
            continue
        if reduce_:
            sch.reorder(*spatial, *reduce_)
        fused = (sch.fuse(*spatial) if len(spatial) > 1 else spatial[0]) if spatial else \
            sch.add_unit_loop(block)
        extent = static_extent(sch, fused)
        _, inner = sch.split(fused, [None, threads])
        sch.bind(inner, "threadIdx.x")
        if registers and reduce_ and sch.get(block).init is not None and \
                writes_alone(sch, block):
            acc = sch.cache_write(block, 0, "local")
            sch.reverse_compute_at(acc, inner)
            if not extent or extent % threads:
                tails[sch.get(acc).name_hint] = sch.get(block).name_hint
    return tails


def mask_write_backs(func, tails):
    """`func` with each register write-back block named in `tails` (`thread_stages`) under the
    predicate of its stage's block: TVM places a write-back over every thread of the stage's
    loop, the masked tail included, whose writes would land past the stage's elements (in
    another thread block's, or past the buffer)."""
    from tvm import s_tir

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
