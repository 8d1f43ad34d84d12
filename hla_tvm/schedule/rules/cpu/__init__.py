"""Default CPU schedule rules, one per module; `apply` runs them in order on a function of a
schedule, `scheduled` on one PrimFunc (remembered per process: the eager kernels and every
compiled model that holds the same kernel share one scheduling)."""
from ...common import ScheduledOnce
from . import matmul_tiles
from .chunk_gemm import chunk_gemm
from .parallel_outer import parallel_outer
from .vectorize_inner import vectorize_inner


def _lanes(target):
    import tvm

    from ....target import resolve
    from .matmul_tiles import vector_lanes

    target = target or tvm.target.Target.current(allow_none=True) or resolve(None)
    return vector_lanes(target)


def apply(sch, func_name, target=None, tunable=False):
    """Apply every default CPU rule to `func_name` in the schedule `sch` (in place; a model's
    projection marked `matmul_tiles.MODEL_MATMUL` gets that rule alone): the outer
    (batch, head, chunk) loops in parallel, register-tiled GEMM blocks for `target`'s vector
    width (the current or host target when None), the other innermost loops vectorized.
    tunable: the tile shapes become sampled decisions (the design space meta_schedule tunes;
    its first point is this default schedule)."""
    sch.work_on(func_name)
    func = sch.mod[func_name]
    if func.attrs and matmul_tiles.MODEL_MATMUL in func.attrs and \
            matmul_tiles.schedule(sch, _lanes(target), tunable):
        return sch   # a model's projection (`schedule.tuning.model.matmuls`)
    parallel_outer(sch, func_name)
    chunk_gemm(sch, func_name, _lanes(target), tunable)
    vectorize_inner(sch, func_name)
    return sch


_SCHEDULED = ScheduledOnce()


def scheduled(func, target=None):
    """`func` (a PrimFunc) with every default CPU rule applied for `target` (as `apply`). Kernels
    equal up to their global_symbol are scheduled once per process and vector width."""
    import tvm
    from tvm import s_tir

    def schedule(plain):
        sch = s_tir.Schedule(tvm.IRModule({"main": plain}))
        apply(sch, "main", target)
        return sch.mod["main"]

    return _SCHEDULED.get(func, _lanes(target), schedule)
