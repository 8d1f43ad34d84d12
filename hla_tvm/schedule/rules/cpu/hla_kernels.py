"""dlight rule: the default CPU schedule of an HLA kernel, its steps in this order:

    matmul_tiles      a model's projection marked `matmul_tiles.MODEL_MATMUL` (that step alone)
    parallel_outer    the outer (batch, head, chunk) loops in parallel
    chunk_gemm        register-tiled GEMM blocks for the target's vector width
    vectorize_inner   the other innermost loops vectorized

`schedule` runs them on a function of an existing schedule (the tuner's design space, where
tunable=True makes the tile shapes sampled decisions whose first point is this default)."""
from __future__ import annotations

from tvm import s_tir
from tvm.s_tir import dlight as dl

from . import matmul_tiles
from .chunk_gemm import chunk_gemm
from .parallel_outer import parallel_outer
from .vectorize_inner import vectorize_inner


def lanes(target):
    """The vector width (float32 lanes) of `target`, the current target or the host's."""
    import tvm

    from ....target import resolve

    target = target or tvm.target.Target.current(allow_none=True) or resolve(None)
    return matmul_tiles.vector_lanes(target)


def schedule(sch, func_name, target=None, tunable=False):
    """Apply the steps above to `func_name` in the schedule `sch` (in place) for `target`."""
    sch.work_on(func_name)
    func = sch.mod[func_name]
    if func.attrs and matmul_tiles.MODEL_MATMUL in func.attrs and \
            matmul_tiles.schedule(sch, lanes(target), tunable):
        return sch   # a model's projection (`schedule.tuning.model.matmuls`)
    parallel_outer(sch, func_name)
    chunk_gemm(sch, func_name, lanes(target), tunable)
    vectorize_inner(sch, func_name)
    return sch


class HLAKernels(dl.ScheduleRule):
    """The default CPU schedule of an HLA kernel (`schedule`), as a dlight rule."""

    def apply(self, func, target, tunable):
        import tvm

        return schedule(s_tir.Schedule(tvm.IRModule({"main": func})), "main", target, tunable)
