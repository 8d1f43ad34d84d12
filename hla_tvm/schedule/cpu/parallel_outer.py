"""Rule: fuse the perfectly nested outermost loops (batch, head[, chunk]) and run them in parallel,
as far down as every iteration writes elements of its own."""
from tvm import tirx

from .common import DATA_PAR, loop_iter_types


def outer_chain(sch):
    """The loops from the root down while each one's body is a single loop (batch, head, ...)."""
    root = sch.get(sch.get_sblock("root"))
    chain = []
    stmt = root.body
    while isinstance(stmt, tirx.For):
        chain.append(stmt)
        stmt = stmt.body
    return chain


def _allocated(stmt, out):
    """Collect into `out` the buffers allocated in `stmt` (AllocBuffer statements and blocks'
    alloc_buffers): scratch of the function, private to the iteration that holds it."""
    if isinstance(stmt, tirx.AllocBuffer):
        out.append(stmt.buffer)
    block = getattr(stmt, "block", None)   # a block realize: look into its block
    if block is not None:
        stmt = block
    out.extend(getattr(stmt, "alloc_buffers", None) or ())
    for name in ("body", "then_case", "else_case"):
        child = getattr(stmt, name, None)
        if isinstance(child, tirx.Stmt):
            _allocated(child, out)
    for child in getattr(stmt, "seq", None) or ():
        _allocated(child, out)
    return out


def _indexes_writes(sch, block, loop, scratch):
    """True when the iterator of `block` bound to `loop` appears in the indices of every region
    the block writes, `scratch` buffers aside: distinct iterations of the loop then write
    distinct elements. (The buffers a function allocates, `scratch`, are placed inside the loop
    when lowered, one per iteration.)"""
    from tvm.tirx.analysis import undefined_vars
    from tvm_ffi import get_global_func

    realize = get_global_func("s_tir.schedule.GetSBlockRealize")(sch, block)
    var = sch.get(loop).loop_var
    mine = [iv.var for iv, value in zip(realize.block.iter_vars, realize.iter_values)
            if any(u.same_as(var) for u in undefined_vars(value))]
    for region in realize.block.writes:
        if any(region.source.same_as(b) for b in scratch):
            continue
        used = [u for r in region.region for u in undefined_vars(r.min)]
        if not any(u.same_as(v) for u in used for v in mine):
            return False
    return True


def parallel_outer(sch, func_name):
    """Fuse the outer loop chain of the function and mark it parallel, down to the first loop
    that some block binds to a non-data-parallel iterator or to one its writes do not depend on
    (a sequential scan over chunks, an in-place state update): those stay serial inside."""
    chain = outer_chain(sch)
    if not chain:
        return
    scratch = _allocated(sch.get(sch.get_sblock("root")), [])
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    loops = sch.get_loops(blocks[0])[: len(chain)]
    keep = len(loops)
    for block in blocks:
        kinds = loop_iter_types(sch, block, loops)
        for i, (loop, kind) in enumerate(zip(loops, kinds)):
            if i >= keep:
                break
            if kind != DATA_PAR or not _indexes_writes(sch, block, loop, scratch):
                keep = i
    loops = loops[:keep]
    if not loops:
        return
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    sch.parallel(fused)
