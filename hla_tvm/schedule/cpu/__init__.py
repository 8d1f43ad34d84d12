"""Default CPU schedule rules, one per module; `apply` runs them in order on every function."""
from .chunk_gemm import chunk_gemm
from .parallel_outer import parallel_outer
from .vectorize_inner import vectorize_inner


def _lanes(target):
    import tvm

    from .matmul_tiles import vector_lanes
    from ...target import resolve

    target = target or tvm.target.Target.current(allow_none=True) or resolve(None)
    return vector_lanes(target)


def apply(sch, func_name, target=None):
    """Apply every default CPU rule to `func_name` in the schedule `sch` (in place): the outer
    (batch, head, chunk) loops in parallel, register-tiled GEMM blocks for `target`'s vector
    width (the current or host target when None), the other innermost loops vectorized."""
    sch.work_on(func_name)
    parallel_outer(sch, func_name)
    chunk_gemm(sch, func_name, _lanes(target))
    vectorize_inner(sch, func_name)
    return sch
