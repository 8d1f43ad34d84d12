"""Rule: an element-wise scan runs one lane per thread, the sequential loop inside.

A kernel whose independent outer loops (batch, head) hold one sequential loop (over chunks)
whose body is sibling loops of one extent, each around one block, is an element-wise
recurrence when each block's iterator of its sibling loop (the lane) is data parallel and
indexes, at one position and as itself, every region the block writes and every region it
reads of a buffer written in that body: lane i then reads and writes elements of lane i only
(`_tir.chunk_scan`: Xc[c, i] = X[i]; X[i] = gl[c] X[i] + dX[c, i]). The sibling loops are
merged into one lane loop, moved outside the sequential loop, fused with the outer loops and
split over thread blocks and threads: B * H * width threads each run the chunks in order on
their own lane (one thread block per (batch, head) gave 32 blocks for an H200's 132
multiprocessors). No barrier is needed: no thread reads another's elements."""
from __future__ import annotations

from tvm.tirx.analysis import undefined_vars
from tvm_ffi import get_global_func

from ...common import (
    DATA_PAR,
    among,
    independent_outer_loops,
    loop_iter_types,
    outer_chain,
    root_blocks,
    static_extent,
)


def _lane_var(sch, block, loop):
    """The iterator of `block` bound to `loop` as the loop variable itself, or None."""
    realize = get_global_func("s_tir.schedule.GetSBlockRealize")(sch, block)
    var = sch.get(loop).loop_var
    for iv, value in zip(realize.block.iter_vars, realize.iter_values):
        if value.same_as(var):
            return iv.var
    return None


def _lane_position(region, lane):
    """The one position where `region` is the single element `lane`; None when the lane is
    absent from it, at several positions or inside an expression."""
    hits = [p for p, r in enumerate(region.region)
            if any(u.same_as(lane) for u in undefined_vars(r.min))
            or any(u.same_as(lane) for u in undefined_vars(r.extent))]
    if len(hits) != 1:
        return None
    r = region.region[hits[0]]
    single = hasattr(r.extent, "value") and int(r.extent.value) == 1
    return hits[0] if single and r.min.same_as(lane) else None


def _lane_blocks(sch, seq_loop, depth):
    """[(lane loop, block)] of the sibling loops under `seq_loop` (the loop at `depth` of the
    outer chain) when they form an element-wise recurrence (module docstring), else None."""
    pairs = []
    for block in sch.get_child_blocks(seq_loop):
        loops = sch.get_loops(block)
        if len(loops) != depth + 2 or len(sch.get_child_blocks(loops[-1])) != 1:
            return None   # not one loop around one block right under the sequential loop
        pairs.append((loops[-1], block))
    extents = {static_extent(sch, lane) for lane, _ in pairs}
    if not pairs or len(extents) != 1 or None in extents:
        return None
    written = [w.source for _, b in pairs for w in sch.get(b).writes]
    positions = []   # (buffer, the lane's position in its indices)
    for lane, block in pairs:
        if loop_iter_types(sch, block, [lane]) != [DATA_PAR]:
            return None
        var = _lane_var(sch, block, lane)
        if var is None:
            return None
        stmt = sch.get(block)
        for region in list(stmt.writes) + [r for r in stmt.reads if among(r.source, written)]:
            pos = _lane_position(region, var)
            seen = [p for buf, p in positions if buf.same_as(region.source)]
            if pos is None or any(p != pos for p in seen):
                return None
            positions.append((region.source, pos))
    return pairs


def scan_lanes(sch, threads):
    """Schedule `sch` as the module docstring says when its function is an element-wise scan;
    returns False (and leaves `sch` as it was) when it is not."""
    outer = independent_outer_loops(sch)
    if not outer or len(outer_chain(sch)) <= len(outer):
        return False
    seq_loop = sch.get_loops(root_blocks(sch)[0])[len(outer)]   # (outer loops: a block)
    pairs = _lane_blocks(sch, seq_loop, len(outer))
    if pairs is None:
        return False
    lanes = [lane for lane, _ in pairs]
    lane = sch.merge(*lanes) if len(lanes) > 1 else lanes[0]
    sch.reorder(lane, seq_loop)
    fused = sch.fuse(*outer, lane)
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return True
