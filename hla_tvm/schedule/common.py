"""Helpers the schedule rules of every target share (not rules themselves)."""
from __future__ import annotations

import threading

import tvm_ffi
from tvm import s_tir, tirx
from tvm.tirx.analysis import undefined_vars
from tvm_ffi import get_global_func

DATA_PAR, COMM_REDUCE = 0, 2   # IterVar kinds: data parallel, commutative reduction
# attribute of a function only a prefill runs (`compiler.passes.prefill_rows`): its symbolic extents
# hold a prompt's many tokens
MANY_ROWS = "hla_tvm.many_rows"


def static_extent(sch, loop):
    """The loop's extent as an int, None when it is symbolic."""
    ext = sch.get(loop).extent
    return int(ext.value) if hasattr(ext, "value") else None


def joint_extent(sch, loops):
    """The iterations `loops` make together: the product of their extents (1 for none), None
    when one is symbolic."""
    out = 1
    for loop in loops:
        ext = static_extent(sch, loop)
        if ext is None:
            return None
        out *= ext
    return out


def under(sch, block, loop):
    """True when `block` lies inside `loop` (a loop RV of the schedule `sch`)."""
    target = sch.get(loop)
    return any(sch.get(lp).same_as(target) for lp in sch.get_loops(block))


def is_elementwise(sch, block):
    """True when every iterator of `block` is data parallel."""
    return all(iv.iter_type == DATA_PAR for iv in sch.get(block).iter_vars)


def inline_elementwise(sch, blocks, *, reverse=False):
    """Inline the element-wise `blocks` wherever the schedule allows: into their consumers
    (compute_inline), and with `reverse` also into their producer (reverse_compute_inline),
    until no more can go. Returns the blocks left."""
    prims = (sch.compute_inline, sch.reverse_compute_inline) if reverse else (sch.compute_inline,)
    left = [b for b in blocks if is_elementwise(sch, b)]
    progress = True
    while progress and left:
        progress = False
        for block in list(left):
            for prim in prims:
                try:
                    prim(block)
                except Exception:  # noqa: BLE001 - an output, or not inlinable this way
                    continue
                left.remove(block)
                progress = True
                break
    return left


def root_block(sch):
    """The root block (SBlockRV) of the function `sch` works on, None where it has none: TVM's
    legalizer emits some kernels (cumsum, scatter_elements: `te.extern` bodies written with the
    IR builder) as one opaque block of loops with another name, which no rule can schedule."""
    try:
        return sch.get_sblock("root")
    except s_tir.ScheduleError:
        return None


def root_blocks(sch):
    """The blocks directly under the root block of the function `sch` works on; none where it
    has no root block (`root_block`)."""
    root = root_block(sch)
    return [] if root is None else list(sch.get_child_blocks(root))


def root_scratch(sch):
    """The buffers the scheduled function allocates on its root block (its scratch); none where
    it has no root block."""
    root = root_block(sch)
    return [] if root is None else list(sch.get(root).alloc_buffers)


def among(buf, bufs):
    """True when `buf` is one of `bufs` (the same buffer)."""
    return any(buf.same_as(b) for b in bufs)


def loop_iter_types(sch, block, loops):
    """For each of `loops`, the type (DATA_PAR, COMM_REDUCE, ...) of the one iterator of `block`
    whose binding uses that loop's variable; None when no iterator or several do. (An in-place
    update's unit reduction axis is bound to no loop, so it never shows up here.)"""
    realize = get_global_func("s_tir.schedule.GetSBlockRealize")(sch, block)
    iters = realize.block.iter_vars
    types = []
    for loop in loops:
        var = sch.get(loop).loop_var
        hits = [iv.iter_type for iv, value in zip(iters, realize.iter_values)
                if any(u.same_as(var) for u in undefined_vars(value))]
        types.append(hits[0] if len(hits) == 1 else None)
    return types


def own_loops(sch, block):
    """The loops that enclose `block` and no other block (innermost last)."""
    own = []
    for loop in reversed(sch.get_loops(block)):
        if len(sch.get_child_blocks(loop)) != 1:
            break
        own.append(loop)
    return own[::-1]


def writes_alone(sch, block):
    """True when no other block under the root writes the buffers `block` writes (a reduction's
    init can then be split off)."""
    me = sch.get(block)
    mine = [r.source for r in me.writes]
    for other in root_blocks(sch):
        if sch.get(other).same_as(me):
            continue
        if any(r.source.same_as(b) for r in sch.get(other).writes for b in mine):
            return False
    return True


def outer_chain(sch):
    """The loops from the root down while each one's body is a single loop (batch, head, ...);
    none where the function has no root block."""
    root = root_block(sch)
    if root is None:
        return []
    root = sch.get(root)
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


def independent_outer_loops(sch):
    """The outer loop chain of the function (`outer_chain`) down to the first loop that some
    block binds to a non-data-parallel iterator or to one its writes do not depend on (a
    sequential scan over chunks, an in-place state update): the loops whose iterations may run
    at once, each on elements of its own."""
    chain = outer_chain(sch)
    blocks = root_blocks(sch)
    if not chain or not blocks:
        return []   # (no loops, or loops around no block: nothing a rule can bind)
    scratch = _allocated(sch.get(root_block(sch)), [])
    loops = sch.get_loops(blocks[0])[: len(chain)]
    keep = len(loops)
    for block in blocks:
        kinds = loop_iter_types(sch, block, loops)
        for i, (loop, kind) in enumerate(zip(loops, kinds)):
            if i >= keep:
                break
            if kind != DATA_PAR or not _indexes_writes(sch, block, loop, scratch):
                keep = i
    return loops[:keep]


def with_children(stmt, rebuild):
    """`stmt` with each statement directly under it replaced by rebuild(child): the statement
    kinds scheduled kernels nest (block realizations, blocks, loops, sequences); any other
    statement is returned as it is."""
    if isinstance(stmt, s_tir.SBlockRealize):
        return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, rebuild(stmt.block))
    if isinstance(stmt, s_tir.SBlock):
        return s_tir.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint,
                            rebuild(stmt.body), stmt.init, stmt.alloc_buffers,
                            stmt.match_buffers, stmt.annotations)
    if isinstance(stmt, tirx.For):
        return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, rebuild(stmt.body),
                        stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([rebuild(s) for s in stmt.seq])
    return stmt


def walk(node, visit):
    """Call visit on `node` and every statement and expression under it (the node kinds kernels
    hold: blocks, loops, sequences, stores, calls, arithmetic)."""
    visit(node)
    for name in ("block", "body", "init", "then_case", "else_case", "value", "a", "b",
                 "condition", "true_value", "false_value"):
        child = getattr(node, name, None)
        if child is not None and not isinstance(child, (str, int, float, bool)):
            walk(child, visit)
    for child in list(getattr(node, "seq", None) or ()) + list(getattr(node, "args", None) or ()):
        walk(child, visit)


def reads_pairs(block):
    """Whether `block` reads a buffer at an index holding (an expression of k) // 2, k its last
    iterator (the reduction): a weight packed two rows a byte (`hla_tvm.quant`, int4), read at
    row k // 2 by a plain product and at g * G / 2 + k // 2 by a group's sum. Such a
    reduction split by twos and unrolled loads each byte once and decides each nibble's select
    when compiling."""
    k = block.iter_vars[-1].var
    found = []

    def uses_k(node):
        if node.same_as(k):
            found.append(True)

    def halves(node):
        if isinstance(node, tirx.FloorDiv) and isinstance(node.b, tirx.IntImm) and \
                int(node.b) == 2:
            walk(node.a, uses_k)

    for read in block.reads:
        for r in read.region:
            walk(r.min, halves)
    return bool(found)


def named_as(func, schedule):
    """schedule(`func` named "main"), named as `func` is (its global_symbol, or none). The
    copy is held here: a function its module alone referenced would be scheduled in place,
    rewriting the caller's function too (its body is shared)."""
    name = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs \
        else None
    out = schedule(func.with_attr("global_symbol", "main"))
    return out if name is None else out.with_attr("global_symbol", name)


class ScheduledOnce:
    """Scheduled kernels remembered per process: `get(func, key, schedule)` returns
    schedule(func named "main") for the first of the kernels equal to `func` up to their
    global_symbol (with the same extra `key`, e.g. a vector width), that result afterwards,
    named as `func` is."""

    def __init__(self):
        self._done: dict = {}
        self._lock = threading.Lock()

    def get(self, func, key, schedule):
        return named_as(func, lambda plain: self._get(plain, key, schedule))

    def _get(self, plain, key, schedule):
        key = (tvm_ffi.structural_hash(plain), key)
        with self._lock:
            hits = self._done.get(key, ())
        for before, after in hits:
            if tvm_ffi.structural_equal(before, plain):
                return after
        after = schedule(plain)
        with self._lock:
            self._done[key] = self._done.get(key, ()) + ((plain, after),)
        return after
