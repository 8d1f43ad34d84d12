"""Default CUDA schedule rules for the HLA kernels, one per module; `scheduled` runs them in
order on one PrimFunc:

    scan_lanes               an element-wise scan: one lane per thread, chunks in order (alone)
    shared_scratch.hoist     scratch allocated in loop bodies declared on the root block
    inline_scratch           element-wise stages of scratch alone computed where they are read
    block_per_outer          independent outer loops (batch, head[, chunk]) -> blockIdx.x
    shared_scratch           scratch in the thread block's shared memory
    thread_stages            each stage's output elements over THREADS threads, sums in registers
    stage_syncs              barriers between stages of kernels updating their state in place

The other functions of a compiled model get TVM's GPU defaults (`dlight`)."""
from __future__ import annotations

from ..common import ScheduledOnce
from .block_per_outer import block_per_outer
from .inline_scratch import inline_scratch
from .scan_lanes import scan_lanes
from .shared_scratch import hoist, shared_scratch
from .stage_syncs import reads_back, updates_in_place, with_syncs
from .thread_stages import chunk_threads, mask_write_backs, stage_threads, thread_stages

THREADS = 128   # threads per block of a kernel updating its state in place: four warps
# threads per block of a chunk kernel whose matrix products fill them (`chunk_threads`): eight
# warps (its shared memory allows one or two blocks per multiprocessor at head size 128)
CHUNK_THREADS = 256


def schedule(func):
    """`func` (an HLA kernel PrimFunc) with every default CUDA rule applied."""
    import tvm
    from tvm import s_tir

    name = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs else None
    # held here: a function the module alone referenced was scheduled in place, rewriting the
    # caller's function too (its body is shared)
    plain = func.with_attr("global_symbol", "main")
    sch = s_tir.Schedule(tvm.IRModule({"main": plain}))
    if scan_lanes(sch, THREADS):
        out = sch.mod["main"]
        return out if name is None else out.with_attr("global_symbol", name)
    plain = hoist(plain)
    sch = s_tir.Schedule(tvm.IRModule({"main": plain}))
    in_place = updates_in_place(sch.mod["main"])
    synced = in_place or reads_back(sch.mod["main"])
    if not in_place:
        inline_scratch(sch, "main")
    block_per_outer(sch, "main")
    shared_scratch(sch, "main")
    threads = stage_threads(sch, THREADS) if in_place else \
        chunk_threads(sch, CHUNK_THREADS, THREADS)
    tails = thread_stages(sch, "main", threads, registers=not in_place)
    out = mask_write_backs(sch.mod["main"], tails)
    if synced:
        out = with_syncs(out)
    return out if name is None else out.with_attr("global_symbol", name)


_SCHEDULED = ScheduledOnce()


def scheduled(func, target=None):
    """`schedule(func)`, remembered per process for structurally equal kernels (the schedule
    does not depend on the GPU's architecture)."""
    return _SCHEDULED.get(func, None, schedule)
