"""Rule: fuse the perfectly nested outermost loops (batch, head[, chunk]) and run them in parallel."""
from tvm import tirx


def outer_chain(sch):
    """The loops from the root down while each one's body is a single loop (batch, head, ...)."""
    root = sch.get(sch.get_sblock("root"))
    chain = []
    stmt = root.body
    while isinstance(stmt, tirx.For):
        chain.append(stmt)
        stmt = stmt.body
    return chain


def parallel_outer(sch, func_name):
    """Fuse the outer loop chain of the function and mark it parallel. The chain must bind only
    data-parallel block iterators (batch, head, chunk), which the HLA kernels guarantee."""
    chain = outer_chain(sch)
    if not chain:
        return
    block = sch.get_child_blocks(sch.get_sblock("root"))[0]
    loops = sch.get_loops(block)[: len(chain)]
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    sch.parallel(fused)
