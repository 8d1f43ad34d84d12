"""Default CPU schedule rules, each a dlight `ScheduleRule` (`apply(func, target, tunable)`
returns a schedule, or None for a function it does not take):

    hla_kernels.HLAKernels           an HLA kernel (its steps, `schedule.steps.cpu`:
                                     parallel_outer, chunk_gemm, vectorize_inner; matmul_tiles
                                     for a tuned projection)
    group_matvec.GroupMatvec         a decode step's int8 / int4 product, scales out of its sums
    matmul_tiles.MatmulTiles         a model's x @ W[K, N] with its element-wise epilogue
    serial_small.SerialSmall         a small function of static shapes, serial
    parallel_fallback.ParallelFallback  the other functions dlight's CPU rules do not take

`scheduled` applies HLAKernels to one PrimFunc, remembered per process (the eager kernels and
every compiled model that holds the same kernel share one scheduling)."""
from ...common import ScheduledOnce
from .group_matvec import GroupMatvec  # noqa: F401
from .hla_kernels import HLAKernels, lanes, schedule, vector_isa  # noqa: F401
from .matmul_tiles import MatmulTiles  # noqa: F401
from .parallel_fallback import ParallelFallback  # noqa: F401
from .serial_small import SerialSmall  # noqa: F401

_SCHEDULED = ScheduledOnce()


def scheduled(func, target=None):
    """`func` (a PrimFunc) with `HLAKernels` applied for `target`. Kernels equal up to their
    global_symbol are scheduled once per process and vector ISA (`vector_isa`)."""
    return _SCHEDULED.get(func, vector_isa(target),
                          lambda plain: HLAKernels().apply(plain, target, False).mod["main"])
