"""dlight rule: the default CPU schedule of an HLA kernel, its steps in this order:

    matmul_tiles      a model's projection marked `matmul_tiles.MODEL_MATMUL` (that step alone)
    parallel_outer    the outer (batch, head, chunk) loops in parallel
    chunk_gemm        register-tiled GEMM blocks for the target's vector width (bfloat16 pair
                      products on vdpbf16ps where the target has AVX512-BF16)
    vectorize_inner   the other innermost loops vectorized

`schedule` runs them on a function of an existing schedule (the tuner's design space, where
tunable=True makes the tile shapes sampled decisions whose first point is this default)."""
from __future__ import annotations

import tvm
from tvm import s_tir
from tvm.s_tir import dlight as dl

from ....ops.common import pairs
from ....target import resolve
from . import matmul_tiles
from ...steps.cpu.chunk_gemm import chunk_gemm
from ...steps.cpu.parallel_outer import parallel_outer
from ...steps.cpu.vectorize_inner import vectorize_inner


def _target(target):
    """`target`, the current target or the host's."""
    return target or tvm.target.Target.current(allow_none=True) or resolve(None)


def lanes(target):
    """The vector width (float32 lanes) of `target`, the current target or the host's."""
    return matmul_tiles.vector_lanes(_target(target))


def vector_isa(target):
    """What the default schedule depends on of `target` (the current or the host's): its
    float32 lanes and whether it has AVX512-BF16's vdpbf16ps."""
    target = _target(target)
    return matmul_tiles.vector_lanes(target), pairs.available(target)


def schedule(sch, func_name, target=None, tunable=False):
    """Apply the steps above to `func_name` in the schedule `sch` (in place) for `target`."""
    sch.work_on(func_name)
    func = sch.mod[func_name]
    if func.attrs and matmul_tiles.MODEL_MATMUL in func.attrs and \
            matmul_tiles.schedule(sch, lanes(target), tunable):
        return sch   # a model's projection (`schedule.tuning.model.matmuls`)
    parallel_outer(sch, func_name)
    width, has_bf16_dot = vector_isa(target)
    chunk_gemm(sch, func_name, width, tunable, has_bf16_dot)
    vectorize_inner(sch, func_name)
    return sch


class HLAKernels(dl.ScheduleRule):
    """The default CPU schedule of an HLA kernel (`schedule`), as a dlight rule."""

    def apply(self, func, target, tunable):
        return schedule(s_tir.Schedule(tvm.IRModule({"main": func})), "main", target, tunable)
