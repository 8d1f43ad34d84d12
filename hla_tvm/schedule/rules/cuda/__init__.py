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

from ...common import ScheduledOnce
from .block_per_outer import block_per_outer
from .inline_scratch import inline_scratch
from .scan_lanes import scan_lanes
from .shared_scratch import hoist, shared_scratch
from .stage_syncs import reads_back, updates_in_place, with_syncs
from .thread_stages import TILES, mask_write_backs, product_threads, stage_threads, thread_stages

THREADS = 128   # threads per block of a kernel updating its state in place: four warps
# threads per block of a chunk kernel whose matrix products fill them (`product_threads`): eight
# warps (its shared memory allows one or two blocks per multiprocessor at head size 128)
CHUNK_THREADS = 256


def schedule(func, *, lanes=True, tiles=TILES, chunk_threads=CHUNK_THREADS):
    """`func` (an HLA kernel PrimFunc) with every default CUDA rule applied. The other
    arguments give variants to time side by side (`benchmarks/gpu_check.py`): lanes=False
    schedules a scan as any in-place kernel (one thread block per (batch, head)), tiles=() sums
    one output per thread, chunk_threads the threads of a chunk kernel whose products fill
    them (`thread_stages.product_threads`)."""
    name = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs else None
    # held here: a function the module alone referenced was scheduled in place, rewriting the
    # caller's function too (its body is shared)
    plain = func.with_attr("global_symbol", "main")
    out = _scheduled(plain, lanes, tiles, chunk_threads)
    return out if name is None else out.with_attr("global_symbol", name)


def _scheduled(plain, lanes, tiles, chunk_threads):
    """`schedule` of the function `plain` (named "main")."""
    import tvm
    from tvm import s_tir

    sch = s_tir.Schedule(tvm.IRModule({"main": plain}))
    if lanes and scan_lanes(sch, THREADS):
        return sch.mod["main"]
    sch = s_tir.Schedule(tvm.IRModule({"main": hoist(plain)}))
    in_place = updates_in_place(sch.mod["main"])
    synced = in_place or reads_back(sch.mod["main"])
    if not in_place:
        inline_scratch(sch, "main")
    block_per_outer(sch, "main")
    shared_scratch(sch, "main")
    threads = stage_threads(sch, THREADS) if in_place else \
        product_threads(sch, chunk_threads, THREADS)
    tails = thread_stages(sch, "main", threads, registers=not in_place, tiles=tiles)
    out = mask_write_backs(sch.mod["main"], tails)
    return with_syncs(out) if synced else out


_SCHEDULED = ScheduledOnce()


def scheduled(func, target=None):
    """`schedule(func)`, remembered per process for structurally equal kernels (the schedule
    does not depend on the GPU's architecture)."""
    return _SCHEDULED.get(func, None, schedule)
