"""dlight rule: the default CUDA schedule of an HLA kernel, its steps in this order:

    scan_lanes               an element-wise scan: one lane per thread, chunks in order (alone)
    shared_scratch.hoist     scratch allocated in loop bodies declared on the root block
    inline_scratch           element-wise stages of scratch alone computed where they are read
    block_per_outer          independent outer loops (batch, head[, chunk]) -> blockIdx.x
    shared_scratch           scratch in the thread block's shared memory
    thread_stages            each stage's output elements over THREADS threads, sums in registers
    stage_syncs              barriers between stages of kernels updating their state in place

The last two rewrite the scheduled function (write-back masks, barriers): `apply` returns a
schedule of the rewritten function, without a trace (CUDA kernels are not tuned)."""
from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.s_tir import dlight as dl

from ...steps.cuda.block_per_outer import block_per_outer
from ...steps.cuda.inline_scratch import inline_scratch
from ...steps.cuda.scan_lanes import scan_lanes
from ...steps.cuda.shared_scratch import hoist, shared_scratch
from ...steps.cuda.stage_syncs import reads_back, updates_in_place, with_syncs
from ...steps.cuda.thread_stages import TILES, mask_write_backs, product_threads, stage_threads, thread_stages

THREADS = 128   # threads per block of a kernel updating its state in place: four warps
# threads per block of a chunk kernel whose matrix products fill them (`product_threads`): eight
# warps (its shared memory allows one or two blocks per multiprocessor at head size 128)
CHUNK_THREADS = 256


def schedule(plain, lanes=True, tiles=TILES, chunk_threads=CHUNK_THREADS):
    """The function `plain` (named "main") with the steps above applied."""
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


class HLAKernels(dl.ScheduleRule):
    """The default CUDA schedule of an HLA kernel (`schedule`), as a dlight rule. The keywords
    give variants to time side by side (`benchmarks/gpu_check`): lanes=False schedules a scan
    as any in-place kernel (one thread block per (batch, head)), tiles=() sums one output per
    thread, chunk_threads the threads of a chunk kernel whose products fill them
    (`thread_stages.product_threads`)."""

    def __init__(self, *, lanes=True, tiles=TILES, chunk_threads=CHUNK_THREADS):
        self.lanes, self.tiles, self.chunk_threads = lanes, tiles, chunk_threads

    def apply(self, func, target, _tunable):
        return s_tir.Schedule(schedule(func.with_attr("global_symbol", "main"), self.lanes,
                                       self.tiles, self.chunk_threads))
