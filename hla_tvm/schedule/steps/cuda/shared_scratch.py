"""Rule: every scratch buffer of a kernel lives in the thread block's shared memory.

A kernel's scratch (chunk tiles, per-head vectors) is written by one thread and read by others,
so on a GPU it must be visible to the whole thread block: its scope becomes dynamic shared
memory ("shared.dyn"; TVM merges those allocations by lifetime and opts in above 48 kB).
Scratch allocated inside a loop body (`T.alloc_buffer`, as the decode and carry kernels do)
cannot be re-scoped by a schedule, so `hoist` first declares it on the root block; a single
value allocated there (a dot product) becomes a register of every thread, each computing it
for itself (`thread_stages`), so that no thread waits on another for it."""
from __future__ import annotations

import re

import tvm

from ...common import among, own_loops, root_block, root_scratch, writes_alone

SCOPE = "shared.dyn"

# a TVMScript line allocating a buffer inside a loop body: "    name = T.alloc_buffer(args)"
_ALLOC = re.compile(r"^[ \t]*(\w+) = T\.alloc_buffer\((.*)\)[ \t]*\n", re.M)
_ROOT = '    # with T.sblock("root"):\n'


def hoist(func):
    """`func` with the buffers allocated inside its loops declared on its root block instead
    (one per thread block once the outer loops are bound to blocks). Unchanged when it has
    none."""
    src = func.script()
    found = _ALLOC.findall(src)
    if not found:
        return func
    if src.count(_ROOT) != 1:
        raise ValueError("shared_scratch.hoist: the kernel's root block was not found in its "
                         "TVMScript")
    decls = "".join(f'    {name} = T.sblock_alloc_buffer({args}, scope='
                    f'"{"local" if args.startswith("(1,)") else SCOPE}")\n'
                    for name, args in found)
    return tvm.script.from_source(_ALLOC.sub("", src).replace(_ROOT, _ROOT + decls))


def _drop_unread(sch, blocks):
    """Remove the element-wise blocks whose scratch output nothing reads (a macro's by-product,
    such as a chunk's total decay where a kernel uses only the per-row weights): TVM would place
    a dead shared buffer apart from the others, which its shared-memory planner rejects."""
    scratch = root_scratch(sch)
    read = [r.source for blk in blocks for r in sch.get(blk).reads]
    left = []
    for block in blocks:
        writes = [r.source for r in sch.get(block).writes]
        dead = all(among(w, scratch) and not among(w, read) for w in writes)
        if dead and sch.get(block).init is None:
            sch.compute_inline(block)   # no consumer: the block goes
        else:
            left.append(block)
    return left


def shared_scratch(sch, func_name):
    """Give every buffer the root block allocates the scope SCOPE (through the first block
    that writes it), but a single value per thread block (written by a block with no loops of
    its own under the thread-block loop, and by no other block: a chunk's total decay) the
    scope "local": a register of every thread, each computing it (`thread_stages`; TVM 0.27's
    shared-memory merging failed on such a one-element shared buffer: InternalError,
    buffer_byte_offsets). Blocks whose scratch nothing reads are removed."""
    root = root_block(sch)
    if root is None:
        return   # (no root block: no scratch declared on it)
    blocks = _drop_unread(sch, sch.get_child_blocks(root))
    for buf in list(sch.get(root).alloc_buffers):
        if buf.scope() == "local":
            continue
        for block in blocks:
            writes = [i for i, r in enumerate(sch.get(block).writes) if r.source.same_as(buf)]
            if writes:
                one = not own_loops(sch, block) and sch.get(block).init is None and \
                    writes_alone(sch, block)
                sch.set_scope(block, writes[0], "local" if one else SCOPE)
                break
