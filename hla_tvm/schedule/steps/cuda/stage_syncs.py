"""Rule: a barrier between the stages of a kernel that updates device memory in place.

TVM inserts barriers for shared memory only. A decode, carry or scan kernel also writes its
state (a kernel argument, in global memory) and reads it back in later stages, where a thread
may read elements another thread wrote (q^T P after P's update). Such kernels get
__syncthreads() between consecutive stages under the thread-block loop and at the end of each
sequential loop over stages (the chunk loop), which orders global as well as shared memory
within the thread block. Kernels that write their arguments only once need none."""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx

from ...common import walk, with_children


def _stage_buffers(func):
    """(names of the buffers func's blocks allocate, [(reads, writes) of each block in program
    order])."""
    scratch, blocks = set(), []

    def visit(node):
        if isinstance(node, s_tir.SBlock):
            scratch.update(b.name for b in node.alloc_buffers)
            blocks.append(({r.source.name for r in node.reads},
                           {w.source.name for w in node.writes}))

    walk(func.body, visit)
    return scratch, blocks


def reads_back(func):
    """True when a block of `func` reads a buffer that another block writes, the buffers it
    allocates aside: a kernel argument written and read back (by other threads, so the stages
    need barriers between them)."""
    scratch, blocks = _stage_buffers(func)
    written = {name for _, writes in blocks for name in writes} - scratch
    return any((reads - writes) & written for reads, writes in blocks)


def updates_in_place(func):
    """True when a block of `func` reads a kernel argument that it or a later block writes:
    the kernel updates it in place (a decode's state, a scan's), which is no stage pipeline."""
    scratch, blocks = _stage_buffers(func)
    later = set()
    for reads, writes in reversed(blocks):
        if (reads - scratch) & (later | writes):
            return True
        later |= writes
    return False


def _sync():
    return tvm.tirx.Evaluate(tvm.tirx.call_intrin("int32", "tirx.tvm_storage_sync", "shared"))


def with_syncs(func):
    """`func` (scheduled: outer loops on blockIdx, stages on threadIdx) with the barriers of
    the module docstring."""
    def rebuild(stmt, in_block):
        if isinstance(stmt, tirx.For):
            tag = stmt.thread_binding.thread_tag if stmt.thread_binding is not None else ""
            if tag.startswith("threadIdx"):
                return stmt   # inside a stage
            inner = in_block or tag.startswith("blockIdx")
            carried = inner and not tag and isinstance(stmt.body, tirx.SeqStmt)

            def body(child):
                out = rebuild(child, inner)
                return tirx.SeqStmt(list(out.seq) + [_sync()]) if carried else out   # loop-carried

            return with_children(stmt, body)
        if isinstance(stmt, tirx.SeqStmt) and in_block:
            parts = [rebuild(s, in_block) for s in stmt.seq]
            out = [parts[0]]
            for part in parts[1:]:
                out += [_sync(), part]
            return tirx.SeqStmt(out)
        return with_children(stmt, lambda child: rebuild(child, in_block))

    return func.with_body(rebuild(func.body, False))
