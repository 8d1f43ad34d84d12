"""Default CPU schedule rules, one per module; `apply` runs them in order on a function of a
schedule, `scheduled` on one PrimFunc (remembered per process: the eager kernels and every
compiled model that holds the same kernel share one scheduling)."""
import threading

from . import matmul_tiles
from .chunk_gemm import chunk_gemm
from .parallel_outer import parallel_outer
from .vectorize_inner import vectorize_inner


def _lanes(target):
    import tvm

    from .matmul_tiles import vector_lanes
    from ...target import resolve

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
        return sch   # a model's projection (`schedule.model.matmuls`)
    parallel_outer(sch, func_name)
    chunk_gemm(sch, func_name, _lanes(target), tunable)
    vectorize_inner(sch, func_name)
    return sch


_SCHEDULED: dict = {}
_LOCK = threading.Lock()


def scheduled(func, target=None):
    """`func` (a PrimFunc) with every default CPU rule applied for `target` (as `apply`). Kernels
    equal up to their global_symbol are scheduled once per process and vector width."""
    import tvm
    import tvm_ffi
    from tvm import s_tir

    name = func.attrs["global_symbol"] if func.attrs and "global_symbol" in func.attrs else None
    plain = func.with_attr("global_symbol", "main")
    key = (tvm_ffi.structural_hash(plain), _lanes(target))
    with _LOCK:
        hits = _SCHEDULED.get(key, ())
    for before, after in hits:
        if tvm_ffi.structural_equal(before, plain):
            break
    else:
        sch = s_tir.Schedule(tvm.IRModule({"main": plain}))
        apply(sch, "main", target)
        before, after = plain, sch.mod["main"]
        with _LOCK:
            _SCHEDULED[key] = _SCHEDULED.get(key, ()) + ((before, after),)
    return after if name is None else after.with_attr("global_symbol", name)
